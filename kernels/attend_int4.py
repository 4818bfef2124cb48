"""Tile loads of the int4 (KIVI) KV cache and the online-softmax fold, for the int4 decode and
prefill kernels (``kivi_decode.py``, ``kivi_prefill.py``).

The layout is :mod:`llmd.quant.kv`'s: data ``[num_blocks, block_size, num_kv_heads, HEAD_DIM //
2]`` uint8, channel ``2j`` in the low nibble of byte ``j`` and ``2j + 1`` in the high one. The
kernels never interleave the nibbles back: they work on **even and odd channels apart**. A score
is ``q · k = q_even · k_low + q_odd · k_high`` (two dots over ``HEAD_DIM / 2``), and the output
is kept as two halves, ``acc_even += p · v_low`` and ``acc_odd += p · v_high``, stored to channels
``2j`` and ``2j + 1``. (Unpacking with ``tl.interleave`` compiled to layout conversions that
spilled up to 9 KB on sm_80 / sm_90; the halves need none.)

* K (:func:`kivi_k_tile`): ``code × scale + zero`` (codes 0..15) with the float16 scale and zero
  point of the (block, KV head) for that channel, in float32 (KIVI, arXiv:2402.02750). A key tile
  is :data:`KEY_TILE` keys of one block, so scale and zero point are ``[HEAD_DIM / 2]`` vectors per tile;
* V (:func:`kivi_v_tile`): ``(code - 8) × scale`` with the float16 scale of the token's group of
  ``V_GROUP`` channels (channels ``2j`` and ``2j + 1`` share group ``j // (V_GROUP / 2)``), in float32;
* the own block's exact K (:func:`own_k_tile`): 16-bit rows of the residual or of a chunk's tail.

Dequantized tiles are cast to the dot dtype (the query's) before ``tl.dot``, as the CPU fast
path casts them to its compute dtype; a float16 dot first clamps to ±65504 (a stale open block's
codes, never selected by the read rule, must not become inf).
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmd.kernels.attend_tile import NEG

F16_MAX = tl.constexpr(65504.0)
#: Keys per tile (``tl.dot``'s minimum): a power-of-two block size ≥ 16 holds whole tiles.
KEY_TILE = 16


@triton.jit
def _to_dot(x, dot_ty: tl.constexpr):
    if dot_ty == tl.float16:
        x = tl.minimum(tl.maximum(x, -F16_MAX), F16_MAX)
    return x.to(dot_ty)


@triton.jit
def _nibbles(ptr, c_off, n_mask, j):
    """Codes 0..15 ``(low, high)``, each ``[TILE, HEAD_DIM / 2]`` int32, of the bytes ``j`` at
    ``ptr + c_off`` (one row per key): channels ``2j`` and ``2j + 1``."""
    byte = tl.load(ptr + c_off[:, None] + j[None, :], mask=n_mask[:, None], other=0).to(tl.int32)
    return byte & 0xF, byte >> 4


@triton.jit
def kivi_k_tile(
    k_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM // 2] uint8 K codes
    ks_ptr, kz_ptr,  # [num_blocks, num_kv_heads, HEAD_DIM] float16 K scales, zero points
    blk,  # int64 scalar: the tile's block id (a tile lies in one block)
    c_off,  # [TILE] int64 offset of each key's (block, offset, head) row in k_ptr
    n_mask, j, kvh, stride_kb, stride_kh, dot_ty: tl.constexpr,
):
    """Dequantized K of even and odd channels ``(k_even, k_odd)``, each ``[TILE, HEAD_DIM / 2]``
    in ``dot_ty`` (``j = arange(HEAD_DIM / 2)``; masked keys read the zero point: they are masked
    out of the scores)."""
    lo, hi = _nibbles(k_ptr, c_off, n_mask, j)
    base = blk * stride_kb + kvh * stride_kh + 2 * j
    k_even = lo.to(tl.float32) * tl.load(ks_ptr + base).to(tl.float32)[None, :] + tl.load(kz_ptr + base).to(
        tl.float32)[None, :]
    k_odd = hi.to(tl.float32) * tl.load(ks_ptr + base + 1).to(tl.float32)[None, :] + tl.load(kz_ptr + base + 1).to(
        tl.float32)[None, :]
    return _to_dot(k_even, dot_ty), _to_dot(k_odd, dot_ty)


@triton.jit
def kivi_v_tile(
    v_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM // 2] uint8 V codes (+ 8)
    vs_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM // V_GROUP] float16 V scales
    blk,  # int64 scalar: the tile's block id
    off,  # [TILE] int64 offsets in the block
    c_off, n_mask, j, kvh, stride_vb, stride_vt, stride_vh, V_GROUP: tl.constexpr, dot_ty: tl.constexpr,
):
    """Dequantized V ``(v_even, v_odd)``, each ``[TILE, HEAD_DIM / 2]`` in ``dot_ty`` (masked keys read 0)."""
    lo, hi = _nibbles(v_ptr, c_off, n_mask, j)
    s_off = (blk * stride_vb + off * stride_vt + kvh * stride_vh)[:, None] + (j // (V_GROUP // 2))[None, :]
    sc = tl.load(vs_ptr + s_off, mask=n_mask[:, None], other=0.0).to(tl.float32)
    return _to_dot((lo - 8).to(tl.float32) * sc, dot_ty), _to_dot((hi - 8).to(tl.float32) * sc, dot_ty)


@triton.jit
def own_k_tile(
    own_ptr,  # [R, num_kv_heads, HEAD_DIM] 16-bit exact K rows (residual or chunk tails)
    rows,  # [TILE] int64 row of each key in own_ptr
    n_mask, j, kvh, stride_or, stride_oh, dot_ty: tl.constexpr,
):
    """Exact K ``(k_even, k_odd)``, each ``[TILE, HEAD_DIM / 2]`` in ``dot_ty`` (masked keys read 0)."""
    base = (rows * stride_or + kvh * stride_oh)[:, None] + 2 * j[None, :]
    k_even = tl.load(own_ptr + base, mask=n_mask[:, None], other=0.0)
    k_odd = tl.load(own_ptr + base + 1, mask=n_mask[:, None], other=0.0)
    return k_even.to(dot_ty), k_odd.to(dot_ty)


@triton.jit
def scores(q_even, q_odd, k_even, k_odd):
    """``q · kᵀ`` ``[M, TILE]`` float32 from the channel halves."""
    s = tl.dot(q_even, tl.trans(k_even), input_precision="ieee")
    return tl.dot(q_odd, tl.trans(k_odd), s, input_precision="ieee")


@triton.jit
def fold(s, visible, v_even, v_odd, m_i, l_i, acc_even, acc_odd, scale):
    """One FlashAttention-2 step (Dao 2023): raw scores ``s [M, TILE]`` (float32, before
    ``scale``), ``visible [M or 1, TILE]``, V halves ``[TILE, HEAD_DIM / 2]`` in the dot dtype, into
    the running max / sum / unnormalized output halves. Returns ``(m_i, l_i, acc_even, acc_odd)``."""
    s = tl.where(visible, s * scale, NEG)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(v_even.dtype)
    acc_even = tl.dot(p, v_even, acc_even * alpha[:, None], input_precision="ieee")
    acc_odd = tl.dot(p, v_odd, acc_odd * alpha[:, None], input_precision="ieee")
    return m_new, l_i, acc_even, acc_odd


def kivi_operands(cache) -> tuple:
    """(K codes, V codes, K scales, K zero points, V scales) views of an int4 :class:`PagedKVCache`
    and their strides ``(stride_cb, stride_ct, stride_ch, stride_kb, stride_kh, stride_vb,
    stride_vt, stride_vh)`` in elements, as the int4 kernels take them."""
    kd, vd = cache.data[0], cache.data[1]
    ks, kz, vs = cache.k_scale(), cache.k_zero(), cache.v_scale()
    strides = (*kd.stride()[:3], *ks.stride()[:2], *vs.stride()[:3])
    return (kd, vd, ks, kz, vs), strides
