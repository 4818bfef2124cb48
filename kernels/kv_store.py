"""Triton ``store_kv``: write new K/V rows into the paged cache at their slots, quantizing on write.

Same layout and numerics as :mod:`llmd.quant.kv` (the torch reference): dynamic scale
``max(amax/qmax, SCALE_FLOOR)`` per (token, KV head) or a static per-tensor scale; ``x / scale``
in float32, clamped to ``±qmax`` before any cast (``.to(tl.int8)`` wraps and out-of-range fp8
casts give NaN), rounded to nearest with ties to even on the format's grid (explicitly, because
``libdevice.rint`` is missing in the interpreter and its fp8 cast mis-rounds at binade edges);
the codes equal torch's ``clamp(x / scale).to(float8)`` / ``torch.round`` bit for bit. Both
divisions are IEEE round-to-nearest (``tl.math.div_rn``; a plain ``/`` may compile to an
approximate division on a GPU) and FMA contraction is off, so a GPU gives the reference's bits.
Before sm_89, e4m3 codes are encoded into uint8 bits in integer arithmetic (``llmd.kernels.launch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmd.kernels.launch import (
    STORE_BLOCK_T,
    Launch,
    cache_operands,
    capability_of,
    check_triton_config,
    fp8_e4m3_in_software,
)
from llmd.quant.kv import SCALE_FLOOR, PagedKVCache


@triton.jit
def _round_half_even(y):
    """Nearest integer, ties to even (``torch.round``, ``llmd.quant.kv.round_half_even``) of float32 ``y``:
    ``f = floor(|y|)``, the fraction ``|y| - f`` is exact, ``f - 2·floor(f/2)`` is f's parity."""
    a = tl.abs(y)
    f = tl.floor(a)
    d = a - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    r = f + tl.where((d > 0.5) | ((d == 0.5) & (odd == 1.0)), 1.0, 0.0)
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit: -0.0 stays -0.0, as in torch


@triton.jit
def _quantize_row(x, s, QMAX: tl.constexpr, FP8: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Codes (float32, on the grid) of ``x / s`` (``[BLOCK_T, HEAD_DIM]`` / ``[BLOCK_T, 1]``)
    clamped to ±QMAX, ties to even."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -QMAX), QMAX)
    if FP8:
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, EMIN) - MANT
        quantum = ((e + 127) << 23).to(tl.float32, bitcast=True)
        return _round_half_even(tl.math.div_rn(y, quantum)) * quantum
    return _round_half_even(y)


@triton.jit
def _e4m3_bits(y):
    """e4m3fn bits (int32 0..255) of float32 values already on its grid and within ±448: normals
    keep float32's top mantissa bits with the exponent rebased (bias 127 → 7), subnormals are
    ``|y| · 2^9`` (an integer 0..7)."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    mag = tl.where(a >= 0.015625, ((bits & 0x7FFFFFFF) >> 20) - (120 << 3), (a * 512.0).to(tl.int32))
    return tl.where(bits < 0, mag | 0x80, mag)


@triton.jit(do_not_specialize=["num_tokens"])  # T changes every step: one compiled variant
def _store_kv_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim] new keys (any float dtype)
    value_ptr,  # [T, num_kv_heads, head_dim] new values
    slot_ptr,  # [T] int64 slot mapping (block_id * block_size + offset; < 0 = skip)
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] K data (storage dtype)
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] V data
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 K scales (unused unless QUANT)
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 V scales
    num_tokens,  # T
    stride_xt, stride_xh,  # key/value strides (elements) over tokens, heads
    stride_cb, stride_ct, stride_ch,  # cache strides over blocks, offsets, heads
    stride_sb, stride_st, stride_sh,  # scale strides over blocks, offsets, heads
    k_static, v_static,  # static per-tensor scales (used if STATIC)
    BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
    STATIC: tl.constexpr, QMAX: tl.constexpr, FP8: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
    FLOOR: tl.constexpr, E4M3_SW: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1)
    t_mask = slot >= 0
    slot = tl.where(t_mask, slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    d = tl.arange(0, HEAD_DIM)
    src = (t * stride_xt + h * stride_xh)[:, None] + d[None, :]
    dst = (blk * stride_cb + off * stride_ct + h * stride_ch)[:, None] + d[None, :]
    k = tl.load(key_ptr + src, mask=t_mask[:, None], other=0.0).to(tl.float32)
    v = tl.load(value_ptr + src, mask=t_mask[:, None], other=0.0).to(tl.float32)
    if QUANT:
        if STATIC:
            ks = tl.zeros([BLOCK_T], tl.float32) + k_static
            vs = tl.zeros([BLOCK_T], tl.float32) + v_static
        else:
            ks = tl.maximum(tl.math.div_rn(tl.max(tl.abs(k), axis=1), QMAX), FLOOR)
            vs = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=1), QMAX), FLOOR)
        k = _quantize_row(k, ks[:, None], QMAX, FP8, MANT, EMIN)
        v = _quantize_row(v, vs[:, None], QMAX, FP8, MANT, EMIN)
        s_off = blk * stride_sb + off * stride_st + h * stride_sh
        tl.store(k_scale_ptr + s_off, ks, mask=t_mask)
        tl.store(v_scale_ptr + s_off, vs, mask=t_mask)
    if E4M3_SW:  # uint8 view of an e4m3 cache (before sm_89)
        k = _e4m3_bits(k)
        v = _e4m3_bits(v)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=t_mask[:, None])
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=t_mask[:, None])


def store_kv_launch(key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor,
                    block_t: int = STORE_BLOCK_T, capability: int | None = None) -> Launch | None:
    """The launch :func:`store_kv` runs (None for no tokens). ``capability`` defaults to the
    device's (:func:`llmd.kernels.launch.capability_of`)."""
    t, h, d = key.shape
    if t == 0:
        return None
    fmt, data = cache.fmt, cache.data
    if fmt.k_per_block:
        raise ValueError("int4 KV caches store through llmd.kernels.kivi (its K waits for the step's residual "
                         "slots), not the Triton store_kv kernel")
    check_triton_config(d, h, h, key.dtype, data.shape[2], fmt.name)
    cap = capability_of(key.device) if capability is None else capability
    key, value = key.contiguous(), value.contiguous()
    kd, vd, ksc, vsc = cache_operands(cache, cap)
    ks, vs = cache.static_scales or (1.0, 1.0)
    args = (key, value, slot_mapping.to(torch.int64), kd, vd, ksc, vsc, t,
            key.stride(0), key.stride(1), *kd.stride()[:3], *ksc.stride()[:3], float(ks), float(vs))
    constexprs = dict(
        BLOCK_T=block_t, BLOCK_SIZE=data.shape[2], HEAD_DIM=d, QUANT=fmt.quantized,
        STATIC=cache.static_scales is not None, QMAX=fmt.qmax or 1.0, FP8=fmt.is_fp8, MANT=fmt.mantissa_bits,
        EMIN=fmt.min_exponent, FLOOR=SCALE_FLOOR,
        E4M3_SW=fp8_e4m3_in_software(fmt.name, cap),
    )
    return Launch(_store_kv_kernel, (triton.cdiv(t, block_t), h), args, constexprs | dict(enable_fp_fusion=False))


def store_kv(key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor,
             block_t: int = STORE_BLOCK_T, capability: int | None = None) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into ``cache`` at ``slot_mapping``
    ``[T]`` int64 (negative slots skipped), quantizing on write. ``head_dim`` must be a power of 2.
    """
    launch = store_kv_launch(key, value, cache, slot_mapping, block_t, capability)
    if launch is not None:
        launch()
