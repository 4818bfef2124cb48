"""Triton paged prefill attention: query chunks attend to the cached prefix and causally to themselves.

Store-then-read: the chunk's own K/V are already in the (quantized) cache and are read back
from it, so results do not depend on chunk size. Grid ``(num_seqs, num_kv_heads,
cdiv(max_query_len, BLOCK_Q))``; one program owns ``BLOCK_Q`` query tokens × the
``GROUP_PAD`` query heads sharing a KV head, flattened into ``BLOCK_M = BLOCK_Q · GROUP_PAD``
rows (row r = token r // GROUP_PAD, head r % GROUP_PAD; padded heads masked), so each K/V
tile is loaded once per group (vLLM ``triton_unified_attention``'s layout). K/V tiles of
``BLOCK_N`` tokens are gathered through the block table and dequantized in registers (scores
× k_scale, probabilities × v_scale). Query at position p sees keys ``0..p`` or, with a
window W, ``p - W + 1 .. p``. Sequences with one query token (decodes) run here too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmd.kernels.attend_tile import NEG, attend_tile
from llmd.quant.kv import PagedKVCache



@triton.jit
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
            kvh, stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh, scale, BLOCK_SIZE, QUANT,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def paged_prefill_attention(
    query: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, max_query_len: int, scale: float, sliding_window: int | None = None,
    block_q: int = 16, block_n: int = 32,
) -> torch.Tensor:
    """Attention for a mixed batch (prefill chunks and decodes) over the paged cache.

    Args:
        query: ``[T, num_heads, head_dim]`` (head_dim a power of 2 ≥ 16).
        cache: the layer's :class:`PagedKVCache` (this step's K/V already stored).
        block_tables: ``[B, max_blocks]`` int32; query_start_loc: ``[B + 1]`` int32;
        seq_lens: ``[B]`` int32; max_query_len: longest chunk (tokens, Python int).
    Returns:
        ``[T, num_heads, head_dim]`` in ``query.dtype``.
    """
    t, nh, hd = query.shape
    data = cache.data
    nkv = data.shape[3]
    group = nh // nkv
    group_pad = triton.next_power_of_2(group)
    block_q = max(block_q, 16 // group_pad)  # BLOCK_M >= 16 for tl.dot
    query = query.contiguous()
    out = torch.empty_like(query)
    sc = cache.scales if cache.fmt.quantized else data[..., 0]
    grid = (seq_lens.shape[0], nkv, triton.cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        query, data[0], data[1], sc[0], sc[1], block_tables, query_start_loc, seq_lens, out,
        query.stride(0), query.stride(1), *data[0].stride()[:3], *sc[0].stride()[:3], block_tables.stride(0),
        float(scale), int(sliding_window or 0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=hd, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_SIZE=data.shape[2], QUANT=cache.fmt.quantized, USE_WINDOW=sliding_window is not None,
    )
    return out
