"""Triton paged decode attention (one query token per sequence), split-KV with a deterministic merge.

Grid ``(num_seqs, num_kv_heads, num_splits)``: each program loads a query group (the
``num_heads / num_kv_heads`` heads sharing one KV head, padded with masked rows to at least 16
for ``tl.dot``, so GQA groups like SmolLM2's 3 work), walks its split of the context in tiles of
``BLOCK_N`` tokens, looks up each token's block through the block table (so tiles need not
align with blocks), and loads each K/V tile once for the whole group. Quantized tiles are
dequantized in registers: scores ``(q · k_code) × k_scale``, and ``p · (v_code × v_scale)`` for
float16 models, ``(p × v_scale) · v_code`` for bfloat16 / float32 (``attend_tile``).
Every program writes an unnormalized partial (acc, running max, running sum); a second kernel
merges the splits in a fixed order (flash-decoding, Dao et al. 2023), so results do not depend
on scheduling; an empty split (a window or a short sequence leaves it no token) weighs 0, and a
row with no token at all gives 0, not 0/0. Semantics as
:func:`llmd.kernels.reference.paged_attention` with one query.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmd.kernels.attend_tile import NEG, attend_tile
from llmd.kernels.launch import (
    DECODE_BLOCK_N,
    Launch,
    cache_operands,
    capability_of,
    check_triton_config,
    fp8_e4m3_in_software,
)
from llmd.quant.kv import PagedKVCache


@triton.jit(do_not_specialize=["stride_bt", "split_len", "num_splits"])  # per-step values: no recompiles
def _decode_split_kernel(
    q_ptr,  # [B, num_heads, HEAD_DIM] queries
    k_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM] K cache data
    v_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM] V cache data
    ks_ptr,  # [num_blocks, block_size, num_kv_heads] float32 K scales (unused unless QUANT)
    vs_ptr,  # [num_blocks, block_size, num_kv_heads] float32 V scales
    bt_ptr,  # [B, max_blocks] int32 block tables
    seq_lens_ptr,  # [B] int32 context lengths (tokens; 0 = a padded row: output 0)
    acc_ptr,  # [B, num_heads, num_splits, HEAD_DIM] float32 unnormalized partial outputs
    m_ptr,  # [B, num_heads, num_splits] float32 partial running max (log-domain)
    l_ptr,  # [B, num_heads, num_splits] float32 partial running sums
    out_ptr,  # [B, num_heads, HEAD_DIM] output (query dtype), written directly when DIRECT
    stride_qb, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_sb, stride_st, stride_sh,
    stride_bt,
    scale, window, split_len, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, USE_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
    E4M3_SW: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # split_len 0: this sequence's own split length, num_splits equal parts of its context rounded up to
    # BLOCK_N (a CUDA graph's fixed grid serves every context; a padded row, seq_len 0, gets no token)
    own = ((seq_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    split_len = tl.where(split_len > 0, split_len, own)
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if USE_WINDOW:
        lo = tl.maximum(lo, seq_len - window)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], NEG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, n, n_mask, n_mask[None, :], d, bt_ptr + b * stride_bt, k_ptr, v_ptr, ks_ptr, vs_ptr,
            kvh, stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh, scale, BLOCK_SIZE, QUANT, E4M3_SW,
        )
    if DIRECT:  # one split: normalize here, no merge kernel
        row = b * (GROUP * tl.num_programs(1)) + heads
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        return
    part = (b * (GROUP * tl.num_programs(1)) + heads) * num_splits + sp
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])
    tl.store(m_ptr + part, m_i, mask=g_mask)
    tl.store(l_ptr + part, l_i, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    acc_ptr,  # [B, num_heads, num_splits, HEAD_DIM] float32 partial outputs
    m_ptr,  # [B, num_heads, num_splits] float32 partial maxima
    l_ptr,  # [B, num_heads, num_splits] float32 partial sums
    out_ptr,  # [B, num_heads, HEAD_DIM] output (query dtype)
    num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * num_heads + h
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    sp_mask = sp < num_splits
    m = tl.load(m_ptr + row * num_splits + sp, mask=sp_mask, other=NEG)
    l = tl.load(l_ptr + row * num_splits + sp, mask=sp_mask, other=0.0)
    acc = tl.load(acc_ptr + (row * num_splits + sp)[:, None] * HEAD_DIM + d[None, :], mask=sp_mask[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(sp_mask & (l > 0), tl.exp(m - m_all), 0.0)  # empty splits (m = NEG, l = 0) weigh 0
    den = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)  # no token at all: 0, not 0/0
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def num_decode_splits(max_seq_len: int, block_n: int, target_tile_per_split: int = 8, max_splits: int = 64) -> int:
    """Splits so that each covers about ``target_tile_per_split`` tiles (1 for short contexts)."""
    tiles = triton.cdiv(max_seq_len, block_n)
    return max(1, min(max_splits, triton.cdiv(tiles, target_tile_per_split)))


def decode_options(dtype: torch.dtype) -> dict:
    """Launch options of the split kernel: Triton's defaults (4 warps, 3 pipeline stages) for
    16-bit models; float32 models (an IEEE float32 dot on FMA units) 8 warps and no software
    pipelining, without which head_dim 128-256 with int8/fp8 KV spill 0.4-8.6 KB (ptxas, sm_80/sm_90)."""
    return dict(num_warps=8, num_stages=1) if dtype == torch.float32 else {}


def decode_launches(
    query: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
    scale: float, sliding_window: int | None = None, num_splits: int | None = None, block_n: int = DECODE_BLOCK_N,
    capability: int | None = None, per_seq_splits: bool = False,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launches :func:`paged_decode_attention` runs (split kernel, then
    the merge unless there is one split). ``capability`` defaults to the device's; ``per_seq_splits``
    passes split length 0 (each program derives its sequence's own from ``seq_lens`` on the device)."""
    bsz, nh, hd = query.shape
    data = cache.data
    nkv = data.shape[3]
    check_triton_config(hd, nh, nkv, query.dtype, data.shape[2], cache.fmt.name, decode_block_n=block_n)
    cap = capability_of(query.device) if capability is None else capability
    group = nh // nkv
    query = query.contiguous()
    splits = num_splits or num_decode_splits(max_seq_len, block_n)
    split_len = 0 if per_seq_splits else triton.cdiv(triton.cdiv(max_seq_len, splits), block_n) * block_n
    dev = query.device
    out = torch.empty_like(query)
    direct = splits == 1
    acc = torch.empty(0 if direct else bsz * nh * splits * hd, dtype=torch.float32, device=dev)
    m = torch.empty(0 if direct else bsz * nh * splits, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    kd, vd, ksc, vsc = cache_operands(cache, cap)
    args = (query, kd, vd, ksc, vsc, block_tables, seq_lens, acc, m, l, out,
            query.stride(0), query.stride(1), *kd.stride()[:3], *ksc.stride()[:3], block_tables.stride(0),
            float(scale), int(sliding_window or 0), split_len, splits)
    constexprs = dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=hd, BLOCK_N=block_n,
        BLOCK_SIZE=data.shape[2], QUANT=cache.fmt.quantized, USE_WINDOW=sliding_window is not None, DIRECT=direct,
        E4M3_SW=fp8_e4m3_in_software(cache.fmt.name, cap),
    )
    launches = [Launch(_decode_split_kernel, (bsz, nkv, splits), args, constexprs | decode_options(query.dtype))]
    if not direct:
        launches.append(Launch(_decode_merge_kernel, (bsz * nh,), (acc, m, l, out, splits),
                               dict(SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=hd)))
    return out, launches


def paged_decode_attention(
    query: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
    scale: float, sliding_window: int | None = None, num_splits: int | None = None, block_n: int = DECODE_BLOCK_N,
    capability: int | None = None, per_seq_splits: bool = False,
) -> torch.Tensor:
    """Decode attention over the paged cache.

    Args:
        query: ``[B, num_heads, head_dim]`` (one token per sequence; head_dim a power of 2 in 16..256).
        cache: the layer's :class:`PagedKVCache` (this step's K/V already stored).
        block_tables: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32 context lengths.
        max_seq_len: ``max(seq_lens)`` as a Python int (sizes the splits; no device sync), or any
            bound on it (a CUDA graph passes ``--max-model-len``).
        num_splits: split-KV factor (None = :func:`num_decode_splits` of ``max_seq_len``).
        capability: compute capability to launch for (None = the device's; tests force 80 under
            the interpreter to run the software e4m3 path).
        per_seq_splits: the grid keeps ``num_splits`` splits per sequence, but each sequence's
            split length is ``ceil(ceil(seq_len / num_splits) / block_n) * block_n`` computed on
            the device instead of one host value from ``max_seq_len`` (CUDA-graph decode:
            arguments fixed at capture, any context up to ``max_seq_len`` at replay).
    Returns:
        ``[B, num_heads, head_dim]`` in ``query.dtype``.
    """
    out, launches = decode_launches(query, cache, block_tables, seq_lens, max_seq_len, scale, sliding_window,
                                    num_splits, block_n, capability, per_seq_splits)
    for launch in launches:
        launch()
    return out
