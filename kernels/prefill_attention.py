"""Triton paged prefill attention: query chunks attend to the cached prefix and causally to themselves.

Store-then-read: the chunk's own K/V are already in the (quantized) cache and are read back
from it, so results do not depend on chunk size. Grid ``(num_seqs, num_kv_heads,
cdiv(max_query_len, BLOCK_Q))``; one program owns ``BLOCK_Q`` query tokens × the
``GROUP_PAD`` query heads sharing a KV head, flattened into ``BLOCK_M = BLOCK_Q · GROUP_PAD``
rows (row r = token r // GROUP_PAD, head r % GROUP_PAD; padded heads masked), so each K/V
tile is loaded once per group (vLLM ``triton_unified_attention``'s layout). K/V tiles of
``BLOCK_N`` tokens are gathered through the block table and dequantized in registers (scores
× k_scale, V codes × v_scale before the dot: ``attend_tile``). Query at position p sees keys ``0..p`` or, with a
window W, ``p - W + 1 .. p``. Sequences with one query token (decodes) run here too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmd.kernels.attend_tile import NEG, attend_tile
from llmd.kernels.launch import (
    PREFILL_BLOCK_N,
    PREFILL_BLOCK_Q,
    Launch,
    cache_operands,
    capability_of,
    check_triton_config,
    fp8_e4m3_in_software,
)
from llmd.quant.kv import PagedKVCache


@triton.jit(do_not_specialize=["stride_bt"])  # the block table width may change per step
def _prefill_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM] queries of all sequences, flattened
    k_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM] K cache data
    v_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM] V cache data
    ks_ptr,  # [num_blocks, block_size, num_kv_heads] float32 K scales (unused unless QUANT)
    vs_ptr,  # [num_blocks, block_size, num_kv_heads] float32 V scales
    bt_ptr,  # [B, max_blocks] int32 block tables
    qsl_ptr,  # [B + 1] int32 query_start_loc
    seq_lens_ptr,  # [B] int32 context lengths after this step (tokens)
    out_ptr,  # [T, num_heads, HEAD_DIM] output (query dtype)
    stride_qt, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_sb, stride_st, stride_sh,
    stride_bt,
    scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, USE_WINDOW: tl.constexpr,
    E4M3_SW: tl.constexpr,
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
    r = tl.arange(0, BLOCK_M)
    qi = qt * BLOCK_Q + r // GROUP_PAD  # query index within the chunk
    g = r % GROUP_PAD
    row_mask = (qi < q_len) & (g < GROUP)
    qpos = ctx + qi
    tok = (q_start + qi).to(tl.int64)
    heads = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q_off = tok * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_mask[:, None], other=0.0)
    hi = tl.minimum(seq_len, ctx + (qt + 1) * BLOCK_Q)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, ctx + qt * BLOCK_Q - window + 1)
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        visible = n_mask[None, :] & (n[None, :] <= qpos[:, None])
        if USE_WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, n, n_mask, visible, d, bt_ptr + b * stride_bt, k_ptr, v_ptr, ks_ptr, vs_ptr,
            kvh, stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh, scale, BLOCK_SIZE, QUANT, E4M3_SW,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def prefill_tile(group: int, head_dim: int, dtype: torch.dtype, block_q: int | None = None,
                 block_n: int | None = None) -> tuple[int, int, int, int, int]:
    """(GROUP_PAD, BLOCK_Q, BLOCK_N, num_warps, num_stages) the engine launches for a query group,
    head_dim and model dtype (None = the choice below). Set from ptxas' register report for
    sm_80 / sm_90 (``tests/test_kernel_compile.py``).

    ``BLOCK_M = BLOCK_Q · GROUP_PAD`` rows (≥ 16 for ``tl.dot``). 16-bit models: 16 query tokens
    but at most 16,384 / head_dim rows (head_dim 256 × GQA 8: 8 tokens × 8 heads; 128 rows spill
    3 KB), 8 warps once ``BLOCK_M × head_dim`` reaches 16,384 (4 warps spill at 128 × 128), and 2
    pipeline stages at head_dim 256 (3 spill with fp8). float32 models (an IEEE float32 dot on
    FMA units): 16 rows, 8 warps, no software pipelining (``num_stages=1``); Triton's defaults (4
    warps, 3 stages) spill 9 KB at 16 rows × head_dim 256 and 17 KB at 64 rows × 128 with int8 KV."""
    group_pad = triton.next_power_of_2(group)
    if dtype == torch.float32:
        rows, stages = 16, 1
    else:
        rows, stages = max(16, min(PREFILL_BLOCK_Q * group_pad, 16384 // head_dim)), 2 if head_dim >= 256 else 3
    bq = block_q if block_q is not None else max(1, rows // group_pad)
    bq = max(bq, 16 // group_pad)  # BLOCK_M >= 16
    bn = block_n if block_n is not None else PREFILL_BLOCK_N
    warps = 8 if dtype == torch.float32 or bq * group_pad * head_dim >= 16384 else 4
    return group_pad, bq, bn, warps, stages


def prefill_launch(
    query: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, max_query_len: int, scale: float, sliding_window: int | None = None,
    block_q: int | None = None, block_n: int | None = None, capability: int | None = None,
) -> tuple[torch.Tensor, Launch]:
    """The output tensor and the launch :func:`paged_prefill_attention` runs (tiles: :func:`prefill_tile`)."""
    t, nh, hd = query.shape
    data = cache.data
    nkv = data.shape[3]
    group_pad, block_q, block_n, num_warps, num_stages = prefill_tile(nh // max(nkv, 1), hd, query.dtype,
                                                                      block_q, block_n)
    check_triton_config(hd, nh, nkv, query.dtype, data.shape[2], cache.fmt.name, prefill_block_n=block_n)
    cap = capability_of(query.device) if capability is None else capability
    group = nh // nkv
    query = query.contiguous()
    out = torch.empty_like(query)
    kd, vd, ksc, vsc = cache_operands(cache, cap)
    grid = (seq_lens.shape[0], nkv, triton.cdiv(max_query_len, block_q))
    args = (query, kd, vd, ksc, vsc, block_tables, query_start_loc, seq_lens, out,
            query.stride(0), query.stride(1), *kd.stride()[:3], *ksc.stride()[:3], block_tables.stride(0),
            float(scale), int(sliding_window or 0))
    constexprs = dict(
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=hd, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_SIZE=data.shape[2], QUANT=cache.fmt.quantized, USE_WINDOW=sliding_window is not None,
        E4M3_SW=fp8_e4m3_in_software(cache.fmt.name, cap), num_warps=num_warps, num_stages=num_stages,
    )
    return out, Launch(_prefill_kernel, grid, args, constexprs)


def paged_prefill_attention(
    query: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, max_query_len: int, scale: float, sliding_window: int | None = None,
    block_q: int | None = None, block_n: int | None = None, capability: int | None = None,
) -> torch.Tensor:
    """Attention for a mixed batch (prefill chunks and decodes) over the paged cache.

    Args:
        query: ``[T, num_heads, head_dim]`` (head_dim a power of 2 in 16..256).
        cache: the layer's :class:`PagedKVCache` (this step's K/V already stored).
        block_tables: ``[B, max_blocks]`` int32; query_start_loc: ``[B + 1]`` int32;
        seq_lens: ``[B]`` int32; max_query_len: longest chunk (tokens, Python int).
        capability: compute capability to launch for (None = the device's).
    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype``.
    """
    out, launch = prefill_launch(query, cache, block_tables, query_start_loc, seq_lens, max_query_len, scale,
                                 sliding_window, block_q, block_n, capability)
    launch()
    return out
