"""Triton paged decode attention over an int4 (KIVI) KV cache: the read rule of
:mod:`llmd.kernels.kivi` for one query per sequence.

Same grid, split-KV and deterministic merge as :mod:`llmd.kernels.decode_attention` (grid
``(num_seqs, num_kv_heads, num_splits)``, the query group padded to ≥ 16 rows, the same merge
kernel), with key tiles of :data:`KEY_TILE` keys inside one block (the block's K scale and zero
point are one vector each; splits are whole blocks; ``block_size`` a power of two ≥ 16) and the
channel halves of :mod:`llmd.kernels.attend_int4`. A decode at
position ``p = seq_len - 1`` has its own block ``[t0, seq_len)``, ``t0 = p - p % block_size``,
so each program walks its split in two ranges:

* ``[lo, min(hi, t0))``: K dequantized from the int4 block (:func:`kivi_k_tile`);
* ``[max(lo, t0), hi)``: K in 16 bits from the residual (``own[own_row[b] + j - t0]``, the
  sequence's residual slot), one tile;

V always per token from the cache (:func:`kivi_v_tile`). Semantics as
:func:`llmd.kernels.reference.paged_attention` with ``tails`` (one query).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmd.kernels.attend_int4 import KEY_TILE, fold, kivi_k_tile, kivi_operands, kivi_v_tile, own_k_tile, scores
from llmd.kernels.attend_tile import NEG
from llmd.kernels.decode_attention import _decode_merge_kernel, decode_options, num_decode_splits
from llmd.kernels.launch import DECODE_BLOCK_N, Launch, check_triton_config
from llmd.quant.kv import PagedKVCache


@triton.jit(do_not_specialize=["stride_bt", "split_len", "num_splits"])
def _kivi_decode_kernel(
    q_ptr,  # [B, num_heads, HEAD_DIM] queries
    k_ptr, v_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM // 2] uint8 K / V codes
    ks_ptr, kz_ptr,  # [num_blocks, num_kv_heads, HEAD_DIM] float16 K scales / zero points
    vs_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM // V_GROUP] float16 V scales
    own_ptr,  # [R * block_size, num_kv_heads, HEAD_DIM] 16-bit residual rows
    own_row_ptr,  # [B] int64 residual row of position t0 (slot * block_size)
    bt_ptr,  # [B, max_blocks] int32 block tables
    seq_lens_ptr,  # [B] int32 context lengths (tokens; 0 = a padded row: output 0)
    acc_ptr, m_ptr, l_ptr,  # [B, num_heads, num_splits(, HEAD_DIM)] float32 partials
    out_ptr,  # [B, num_heads, HEAD_DIM] output (query dtype), written directly when DIRECT
    stride_qb, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_kb, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_or, stride_oh,
    stride_bt,
    scale, window, split_len, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, V_GROUP: tl.constexpr, USE_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if USE_WINDOW:
        lo = tl.maximum(lo, seq_len - window)
    t0 = tl.maximum(seq_len - 1, 0) // BLOCK_SIZE * BLOCK_SIZE  # the own block's first position
    own_row = tl.load(own_row_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    j = tl.arange(0, HEAD_DIM // 2)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    q_off = b * stride_qb + heads[:, None] * stride_qh + 2 * j[None, :]
    q_even = tl.load(q_ptr + q_off, mask=g_mask[:, None], other=0.0)
    q_odd = tl.load(q_ptr + q_off + 1, mask=g_mask[:, None], other=0.0)
    dot_ty = q_even.dtype
    m_i = tl.full([GROUP_PAD], NEG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc_even = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)
    acc_odd = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    t = tl.arange(0, TILE)
    end = tl.minimum(hi, t0)
    for jt in range(lo // TILE, tl.cdiv(end, TILE)):  # earlier blocks: int4 K
        n = jt * TILE + t
        n_mask = (n >= lo) & (n < end)
        blk = tl.load(bt_row + jt * TILE // BLOCK_SIZE).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        c_off = blk * stride_cb + off * stride_ct + kvh * stride_ch
        k_even, k_odd = kivi_k_tile(k_ptr, ks_ptr, kz_ptr, blk, c_off, n_mask, j, kvh, stride_kb, stride_kh, dot_ty)
        s = scores(q_even, q_odd, k_even, k_odd)
        v_even, v_odd = kivi_v_tile(v_ptr, vs_ptr, blk, off, c_off, n_mask, j, kvh, stride_vb, stride_vt, stride_vh,
                                    V_GROUP, dot_ty)
        m_i, l_i, acc_even, acc_odd = fold(s, n_mask[None, :], v_even, v_odd, m_i, l_i, acc_even, acc_odd, scale)
    for jt in range(tl.maximum(lo, t0) // TILE, tl.cdiv(hi, TILE)):  # the own block: 16-bit K from the residual
        n = jt * TILE + t
        n_mask = (n >= lo) & (n < hi)
        blk = tl.load(bt_row + jt * TILE // BLOCK_SIZE).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        c_off = blk * stride_cb + off * stride_ct + kvh * stride_ch
        k_even, k_odd = own_k_tile(own_ptr, own_row + (n - t0), n_mask, j, kvh, stride_or, stride_oh, dot_ty)
        s = scores(q_even, q_odd, k_even, k_odd)
        v_even, v_odd = kivi_v_tile(v_ptr, vs_ptr, blk, off, c_off, n_mask, j, kvh, stride_vb, stride_vt, stride_vh,
                                    V_GROUP, dot_ty)
        m_i, l_i, acc_even, acc_odd = fold(s, n_mask[None, :], v_even, v_odd, m_i, l_i, acc_even, acc_odd, scale)
    if DIRECT:  # one split: normalize here, no merge kernel
        row = b * (GROUP * tl.num_programs(1)) + heads
        den = tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = row[:, None] * HEAD_DIM + 2 * j[None, :]
        tl.store(out_ptr + o_off, (acc_even / den).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        tl.store(out_ptr + o_off + 1, (acc_odd / den).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        return
    part = (b * (GROUP * tl.num_programs(1)) + heads) * num_splits + sp
    a_off = part[:, None] * HEAD_DIM + 2 * j[None, :]
    tl.store(acc_ptr + a_off, acc_even, mask=g_mask[:, None])
    tl.store(acc_ptr + a_off + 1, acc_odd, mask=g_mask[:, None])
    tl.store(m_ptr + part, m_i, mask=g_mask)
    tl.store(l_ptr + part, l_i, mask=g_mask)


def kivi_decode_launches(
    query: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    own: torch.Tensor, own_rows: torch.Tensor, max_seq_len: int, scale: float, sliding_window: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launches :func:`kivi_paged_decode_attention` runs (the int4 split
    kernel, then :mod:`llmd.kernels.decode_attention`'s merge unless there is one split)."""
    bsz, nh, hd = query.shape
    nkv, bs = cache.data.shape[3], cache.block_size
    check_triton_config(hd, nh, nkv, query.dtype, bs, cache.fmt.name)
    query = query.contiguous()
    splits = num_splits or num_decode_splits(max_seq_len, DECODE_BLOCK_N)  # the 16-bit decode's counts
    split_len = triton.cdiv(triton.cdiv(max_seq_len, splits), bs) * bs  # whole blocks: a key tile is one block
    dev = query.device
    out = torch.empty_like(query)
    direct = splits == 1
    acc = torch.empty(0 if direct else bsz * nh * splits * hd, dtype=torch.float32, device=dev)
    m = torch.empty(0 if direct else bsz * nh * splits, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    ops, strides = kivi_operands(cache)
    args = (query, *ops, own, own_rows, block_tables, seq_lens, acc, m, lsum, out, query.stride(0), query.stride(1),
            *strides, own.stride(0), own.stride(1), block_tables.stride(0), float(scale), int(sliding_window or 0),
            split_len, splits)
    constexprs = dict(
        GROUP=nh // nkv, GROUP_PAD=max(16, triton.next_power_of_2(nh // nkv)), HEAD_DIM=hd, BLOCK_SIZE=bs,
        TILE=KEY_TILE, V_GROUP=cache.fmt.group_size, USE_WINDOW=sliding_window is not None, DIRECT=direct,
    )
    launches = [Launch(_kivi_decode_kernel, (bsz, nkv, splits), args, constexprs | decode_options(query.dtype))]
    if not direct:
        launches.append(Launch(_decode_merge_kernel, (bsz * nh,), (acc, m, lsum, out, splits),
                               dict(SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=hd)))
    return out, launches


def kivi_paged_decode_attention(
    query: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    own: torch.Tensor, own_rows: torch.Tensor, max_seq_len: int, scale: float, sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention over an int4 paged cache (this step's K already stored: :func:`llmd.kernels.kivi.store_keys`).

    Args:
        query: ``[B, num_heads, head_dim]`` (head_dim a power of 2 in 16..256).
        cache: the layer's int4 :class:`PagedKVCache`.
        block_tables: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32 context lengths.
        own: ``[R * block_size, num_kv_heads, head_dim]`` 16-bit: the residual viewed as rows.
        own_rows: ``[B]`` int64: row of each sequence's own block's first position (``slot · block_size``).
        max_seq_len: a bound on ``seq_lens`` (sizes the splits); num_splits: None = from it.
    Returns:
        ``[B, num_heads, head_dim]`` in ``query.dtype``.
    """
    out, launches = kivi_decode_launches(query, cache, block_tables, seq_lens, own, own_rows, max_seq_len, scale,
                                         sliding_window, num_splits)
    for launch in launches:
        launch()
    return out
