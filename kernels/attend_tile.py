"""One online-softmax step over a tile of paged K/V, shared by the decode and prefill kernels.

FlashAttention-2's inner loop (Dao 2023): gather ``BLOCK_N`` keys through the block table,
dequantize in registers and fold the tile into the running max ``m``, running sum ``l`` and
unnormalized output ``acc``. K: scores ``(q · k_code) × k_scale`` (codes are exact in every dot
dtype: |code| ≤ 57,344 < float16's 65,504; the dot accumulates in float32). V, float16 models:
``v_code × v_scale`` in float32 first, then the cast to float16, so ``p × v_scale`` (which
underflows float16 for small scales: 1e-3 / 448 ≈ 2e-6 is subnormal) is never formed; float32
and bfloat16 (float32's exponent range) keep ``(p × v_scale) · v_code``, which needs no float32
V tile in registers (the float32 decode kernel spills with one).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Finite "minus infinity": fully masked tiles never produce inf - inf = NaN. A ``tl.constexpr``
#: so compiled kernels may read it (a plain global is a NameError outside the interpreter).
NEG = tl.constexpr(-1.0e30)


@triton.jit
def e4m3_value(c):
    """float32 value of e4m3fn bits ``c`` (a uint8 tensor; 0x7F/0xFF, NaN, are never stored):
    normals rebase the exponent (bias 7 → 127) under float32's top mantissa bits, subnormals are
    ``mantissa · 2^-9``."""
    c = c.to(tl.int32)
    mag = c & 0x7F
    normal = ((mag + (120 << 3)) << 20).to(tl.float32, bitcast=True)
    val = tl.where(mag >= 8, normal, mag.to(tl.float32) * 0.001953125)
    return tl.where(c >= 0x80, -val, val)


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
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, E4M3_SW: tl.constexpr,
):
    dot_ty = q.dtype
    blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    off = (n % BLOCK_SIZE).to(tl.int64)
    c_off = blk * stride_cb + off * stride_ct + kvh * stride_ch
    k = tl.load(k_ptr + c_off[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
    if E4M3_SW:
        k = e4m3_value(k)
    s = tl.dot(q, tl.trans(k.to(dot_ty)), input_precision="ieee")
    if QUANT:
        s_off = blk * stride_sb + off * stride_st + kvh * stride_sh
        k_sc = tl.load(ks_ptr + s_off, mask=n_mask, other=0.0)
        s = s * k_sc[None, :]
    s = tl.where(visible, s * scale, NEG)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + c_off[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
    if E4M3_SW:
        v = e4m3_value(v)
    if QUANT:
        v_sc = tl.load(vs_ptr + s_off, mask=n_mask, other=0.0)
        if dot_ty == tl.float16:  # p · (code × scale): p × v_scale would underflow float16
            v = v.to(tl.float32) * v_sc[:, None]
        else:  # float32 / bfloat16 range: (p × v_scale) · code, fewer registers than a float32 V tile
            p = p * v_sc[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v.to(dot_ty), input_precision="ieee")
    return m_new, l_i, acc
