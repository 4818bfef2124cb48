"""One online-softmax step over a tile of paged K/V, shared by the decode and prefill kernels.

FlashAttention-2's inner loop (Dao 2023): gather ``BLOCK_N`` keys through the block table,
dequantize in registers (scores × k_scale, probabilities × v_scale), and fold the tile into
the running max ``m``, running sum ``l`` and unnormalized output ``acc``.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG = -1.0e30  # finite "minus infinity": fully masked tiles never produce inf - inf = NaN


@triton.jit
def attend_tile(
    q,  # [M, HEAD_DIM] query rows (the loaded tile, not a pointer)
    m_i, l_i, acc,  # [M] float32 running max, [M] float32 running sum, [M, HEAD_DIM] float32 output
    n,  # [BLOCK_N] token indices of this key tile
    n_mask,  # [BLOCK_N] tokens that exist (n < end of range)
    visible,  # [M or 1, BLOCK_N] which (query row, key) pairs attend (causal / window / n_mask)
    d,  # [HEAD_DIM] arange
    bt_row_ptr,  # [max_blocks] int32 block table of this sequence
    k_ptr, v_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM] cache data
    ks_ptr, vs_ptr,  # [num_blocks, block_size, num_kv_heads] float32 scales (unused unless QUANT)
    kvh,  # int64 KV head
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
    scale,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
):
    dot_ty = q.dtype
    blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    off = (n % BLOCK_SIZE).to(tl.int64)
    c_off = blk * stride_cb + off * stride_ct + kvh * stride_ch
    k = tl.load(k_ptr + c_off[:, None] + d[None, :], mask=n_mask[:, None], other=0.0).to(dot_ty)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if QUANT:
        s_off = blk * stride_sb + off * stride_st + kvh * stride_sh
        k_sc = tl.load(ks_ptr + s_off, mask=n_mask, other=0.0)
        s = s * k_sc[None, :]
    s = tl.where(visible, s * scale, NEG)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + c_off[:, None] + d[None, :], mask=n_mask[:, None], other=0.0).to(dot_ty)
    if QUANT:
        v_sc = tl.load(vs_ptr + s_off, mask=n_mask, other=0.0)
        p = p * v_sc[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v, input_precision="ieee")
    return m_new, l_i, acc
