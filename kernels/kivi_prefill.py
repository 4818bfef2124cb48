"""Triton paged prefill attention over an int4 (KIVI) KV cache: the read rule of
:mod:`llmd.kernels.kivi` for a mixed batch (prefill chunks and decodes).

Same grid and row layout as :mod:`llmd.kernels.prefill_attention` (``(num_seqs, num_kv_heads,
cdiv(max_query_len, BLOCK_Q))``, ``BLOCK_M = BLOCK_Q · GROUP_PAD`` rows; tiles and warps:
:func:`kivi_prefill_tile`), with key tiles of :data:`KEY_TILE` keys inside one block (the block's
K scale and zero point one vector each; ``block_size`` a power of two ≥ 16) and the channel
halves of :mod:`llmd.kernels.attend_int4`. A query at position ``p`` reads key ``j`` dequantized
from int4 when ``j`` is in an earlier block than ``p``'s, and in 16 bits when both share a
block. Each program walks two key ranges, and every (row, key) pair is visible in exactly one
of them (the online softmax may fold a key twice for different rows):

* keys ``[lo, min(hi, last_lo))`` (``last_lo`` the first position of the last row's block): int4
  K, visible to the rows in a later block than the key's;
* keys ``[max(lo, own_lo), hi)`` (``own_lo`` the first position of the first row's block): 16-bit
  K, visible to the rows in the key's block.

So no tile holds two score tiles at once (computing both and choosing per row spilled up to
600 B on sm_80 / sm_90).

The exact K of a sequence's positions ``t0 .. seq_len - 1`` (``t0 = ctx - ctx % block_size``) are
rows ``own_row[b] ..`` of ``own``: the chunk's tail from :func:`llmd.kernels.kivi.store_keys`
(a long chunk overwrites the residual block by block), a decode's residual block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmd.kernels.attend_int4 import KEY_TILE, fold, kivi_k_tile, kivi_operands, kivi_v_tile, own_k_tile, scores
from llmd.kernels.attend_tile import NEG
from llmd.kernels.launch import Launch, check_triton_config
from llmd.kernels.prefill_attention import prefill_tile
from llmd.quant.kv import PagedKVCache


@triton.jit(do_not_specialize=["stride_bt"])
def _kivi_prefill_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM] queries of all sequences, flattened
    k_ptr, v_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM // 2] uint8 K / V codes
    ks_ptr, kz_ptr,  # [num_blocks, num_kv_heads, HEAD_DIM] float16 K scales / zero points
    vs_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM // V_GROUP] float16 V scales
    own_ptr,  # [R, num_kv_heads, HEAD_DIM] 16-bit exact K (chunk tails, decodes' residual blocks)
    own_row_ptr,  # [B] int64 row in own_ptr of each sequence's position t0
    bt_ptr,  # [B, max_blocks] int32 block tables
    qsl_ptr,  # [B + 1] int32 query_start_loc
    seq_lens_ptr,  # [B] int32 context lengths after this step (tokens)
    out_ptr,  # [T, num_heads, HEAD_DIM] output (query dtype)
    stride_qt, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_kb, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_or, stride_oh,
    stride_bt,
    scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, V_GROUP: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    qt = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if qt * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # tokens cached before this chunk
    t0 = ctx // BLOCK_SIZE * BLOCK_SIZE  # first position held in own_ptr
    own_lo = (ctx + qt * BLOCK_Q) // BLOCK_SIZE * BLOCK_SIZE  # the block of this tile's first query
    own_row = tl.load(own_row_ptr + b)
    r = tl.arange(0, BLOCK_M)
    qi = qt * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    row_mask = (qi < q_len) & (g < GROUP)
    qpos = ctx + qi
    tok = (q_start + qi).to(tl.int64)
    heads = kvh * GROUP + g
    j = tl.arange(0, HEAD_DIM // 2)
    q_off = (tok * stride_qt + heads * stride_qh)[:, None] + 2 * j[None, :]
    q_even = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)
    q_odd = tl.load(q_ptr + q_off + 1, mask=row_mask[:, None], other=0.0)
    dot_ty = q_even.dtype
    hi = tl.minimum(seq_len, ctx + (qt + 1) * BLOCK_Q)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, ctx + qt * BLOCK_Q - window + 1)
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_even = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    acc_odd = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    t = tl.arange(0, TILE)
    row_blk = (qpos // BLOCK_SIZE)[:, None]
    end = (hi - 1) // BLOCK_SIZE * BLOCK_SIZE  # last_lo: keys of the last row's block are read in 16 bits only
    for jt in range(lo // TILE, tl.cdiv(end, TILE)):  # int4 K, for rows in later blocks than the key's
        n = jt * TILE + t
        n_mask = (n >= lo) & (n < end)
        visible = n_mask[None, :] & (n[None, :] <= qpos[:, None]) & (jt * TILE // BLOCK_SIZE < row_blk)
        if USE_WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        blk = tl.load(bt_row + jt * TILE // BLOCK_SIZE).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        c_off = blk * stride_cb + off * stride_ct + kvh * stride_ch
        k_even, k_odd = kivi_k_tile(k_ptr, ks_ptr, kz_ptr, blk, c_off, n_mask, j, kvh, stride_kb, stride_kh, dot_ty)
        s = scores(q_even, q_odd, k_even, k_odd)
        v_even, v_odd = kivi_v_tile(v_ptr, vs_ptr, blk, off, c_off, n_mask, j, kvh, stride_vb, stride_vt, stride_vh,
                                    V_GROUP, dot_ty)
        m_i, l_i, acc_even, acc_odd = fold(s, visible, v_even, v_odd, m_i, l_i, acc_even, acc_odd, scale)
    for jt in range(tl.maximum(lo, own_lo) // TILE, tl.cdiv(hi, TILE)):  # 16-bit K, for rows in the key's block
        n = jt * TILE + t
        n_mask = (n >= lo) & (n < hi)
        visible = n_mask[None, :] & (n[None, :] <= qpos[:, None]) & (jt * TILE // BLOCK_SIZE == row_blk)
        if USE_WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        blk = tl.load(bt_row + jt * TILE // BLOCK_SIZE).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        c_off = blk * stride_cb + off * stride_ct + kvh * stride_ch
        k_even, k_odd = own_k_tile(own_ptr, own_row + (n - t0), n_mask, j, kvh, stride_or, stride_oh, dot_ty)
        s = scores(q_even, q_odd, k_even, k_odd)
        v_even, v_odd = kivi_v_tile(v_ptr, vs_ptr, blk, off, c_off, n_mask, j, kvh, stride_vb, stride_vt, stride_vh,
                                    V_GROUP, dot_ty)
        m_i, l_i, acc_even, acc_odd = fold(s, visible, v_even, v_odd, m_i, l_i, acc_even, acc_odd, scale)
    den = tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off, (acc_even / den).to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    tl.store(out_ptr + q_off + 1, (acc_odd / den).to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def kivi_prefill_tile(group: int, head_dim: int, dtype: torch.dtype, block_q: int | None = None
                      ) -> tuple[int, int, int, int]:
    """(GROUP_PAD, BLOCK_Q, num_warps, num_stages) of the int4 kernel. float32 models:
    :func:`~llmd.kernels.prefill_attention.prefill_tile`'s (16 rows, 8 warps, 1 stage). 16-bit
    models: at most 4,096 / head_dim rows (64 at head_dim 64, 16 at 256; ``BLOCK_M ≥ 16``) and 4
    warps, since the int4 tile adds the dequantized K and V halves and their scales to the 16-bit
    kernel's registers: its 128 rows at head_dim 128 spilled 256 B, 64 at head_dim 256 480 B
    (ptxas, sm_80 / sm_90; ``tests/kernels/test_kernel_compile.py`` asserts no spills)."""
    group_pad, bq, _, warps, stages = prefill_tile(group, head_dim, dtype, block_q)
    if dtype != torch.float32:
        warps = 4
        if block_q is None:
            bq = max(1, max(16, min(16 * group_pad, 4096 // head_dim)) // group_pad)
    return group_pad, max(bq, 16 // group_pad), warps, stages


def kivi_prefill_launch(
    query: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, own: torch.Tensor, own_rows: torch.Tensor, max_query_len: int, scale: float,
    sliding_window: int | None = None, block_q: int | None = None,
) -> tuple[torch.Tensor, Launch]:
    """The output tensor and the launch :func:`kivi_paged_prefill_attention` runs (query tiles and
    warps: :func:`kivi_prefill_tile`)."""
    t, nh, hd = query.shape
    nkv, bs = cache.data.shape[3], cache.block_size
    group_pad, block_q, num_warps, num_stages = kivi_prefill_tile(nh // max(nkv, 1), hd, query.dtype, block_q)
    check_triton_config(hd, nh, nkv, query.dtype, bs, cache.fmt.name)
    query = query.contiguous()
    out = torch.empty_like(query)
    ops, strides = kivi_operands(cache)
    grid = (seq_lens.shape[0], nkv, triton.cdiv(max_query_len, block_q))
    args = (query, *ops, own, own_rows, block_tables, query_start_loc, seq_lens, out, query.stride(0),
            query.stride(1), *strides, own.stride(0), own.stride(1), block_tables.stride(0), float(scale),
            int(sliding_window or 0))
    constexprs = dict(
        GROUP=nh // nkv, GROUP_PAD=group_pad, HEAD_DIM=hd, BLOCK_Q=block_q, BLOCK_SIZE=bs, TILE=KEY_TILE,
        V_GROUP=cache.fmt.group_size, USE_WINDOW=sliding_window is not None, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, Launch(_kivi_prefill_kernel, grid, args, constexprs)


def kivi_paged_prefill_attention(
    query: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, own: torch.Tensor, own_rows: torch.Tensor, max_query_len: int, scale: float,
    sliding_window: int | None = None, block_q: int | None = None,
) -> torch.Tensor:
    """Attention for a mixed batch over an int4 paged cache (this step's K already stored).

    Args:
        query: ``[T, num_heads, head_dim]`` (head_dim a power of 2 in 16..256).
        cache: the layer's int4 :class:`PagedKVCache`.
        block_tables: ``[B, max_blocks]`` int32; query_start_loc: ``[B + 1]`` int32;
        seq_lens: ``[B]`` int32; max_query_len: longest chunk (tokens, Python int).
        own: ``[R, num_kv_heads, head_dim]`` 16-bit exact K; own_rows: ``[B]`` int64, the row of
            sequence ``b``'s position ``t0 = ctx - ctx % block_size`` (its rows run to ``seq_len - 1``).
    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype``.
    """
    out, launch = kivi_prefill_launch(query, cache, block_tables, query_start_loc, seq_lens, own, own_rows,
                                      max_query_len, scale, sliding_window, block_q)
    launch()
    return out
