"""The torch reference of the quantized KV formats: scales, codes, packing and dequantization.

Every function here works on K/V values shaped ``[..., num_kv_heads, head_dim]`` (any float
dtype) and returns codes in the format's storage dtype (``torch.int8``,
``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, or ``head_dim // 2`` uint8 for int4) or scales
in float32 (float16-rounded for int4); the layout they are stored in is :mod:`llmd.quant.kv`'s.
int4 follows KIVI (arXiv:2402.02750): K per (block, KV head, channel) asymmetric over the block's
tokens (:func:`quantize_k_blocks`), V per token symmetric per 16 channels (:func:`quantize`).

Value = stored code × scale (in float32). Scales are *dynamic* by default, computed when K/V
are written: ``scale = max(amax(|x|) / qmax, SCALE_FLOOR)`` over the head_dim values of one
(token, head) (symmetric int8 as in KIVI/vLLM per-token int8; amax-based fp8). With static
per-tensor scales (``--kv-scales k,v``, vLLM's ``k_scale``/``v_scale`` convention: stored =
x / scale) the same slots hold the constant, so every read path is identical.

Rounding (the same in the Triton kernels, ``kernels/kv_store.py``): values are divided by the
scale in float32, clamped to ``[-qmax, qmax]`` (no inf/NaN from out-of-range casts) and
rounded to the format's grid to nearest with **ties to even** (:func:`round_half_even` on the
grid's quantum): the rule of ``torch.round``, of torch's own float32 → float8 casts, of the
hardware ``cvt.rn`` conversions and of vLLM's int8/fp8 quantization, so the codes are bit for
bit those of ``clamp(x / scale).to(float8)`` (tested). For fp8 the rounding to the e4m3/e5m2
grid is done explicitly in float32 (the quantum ``2^(max(e, e_min) - mantissa_bits)`` from the
float32 exponent bits), so the final cast is exact; this avoids relying on the cast's own
rounding, which the Triton interpreter gets wrong when rounding crosses a power of two.
Dequantization is ``code × scale`` in float32 (or float64 for oracles), never through the
model dtype.

These names are re-exported by :mod:`llmd.quant.kv`; the formats (:class:`KVCacheFormat`) are
:mod:`llmd.quant.kv_format`'s.
"""

from __future__ import annotations

import torch

from llmd.quant.kv_format import KVCacheFormat

#: Smallest scale: an all-zero (token, head) vector gives scale 1e-8 and codes 0, never NaN.
SCALE_FLOOR = 1e-8
SCALE_DTYPE = torch.float32
#: float16 scales (int4): the smallest normal float16 (tinier groups quantize to 0) and the largest finite one
F16_SCALE_FLOOR, F16_SCALE_MAX = 2.0**-14, 65504.0


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, ties to even (IEEE ``roundTiesToEven``): ``torch.round``.

    The Triton store kernel spells the same rule out (``floor``, the exact fraction ``a - f``,
    parity of ``f``) because ``libdevice.rint`` is missing from the interpreter; the two agree bit
    for bit (``tests/test_kernels.py``)."""
    return torch.round(x)


def fp8_quantum(y: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """Spacing of ``fmt``'s grid around float32 ``y``: ``2^(max(e, e_min) - mantissa_bits)``,
    ``e`` read from the float32 exponent bits (exact, no log2)."""
    e = ((y.view(torch.int32) >> 23) & 0xFF) - 127
    e = torch.clamp(e, min=fmt.min_exponent) - fmt.mantissa_bits
    return ((e + 127) << 23).view(torch.float32)


def compute_scales(x: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """Dynamic scales ``max(amax(|x|) / qmax, SCALE_FLOOR)``.

    Args:
        x: ``[T, num_kv_heads, head_dim]`` any float dtype.
    Returns:
        ``[T, num_kv_heads]`` float32, or ``[T, num_kv_heads, head_dim // group_size]`` for a
        grouped format (amax over each group of channels; for float16-scale formats clamped to
        ``[2^-14, 65504]`` and rounded to float16, returned as float32).
    """
    x = x.float()
    if fmt.group_size:
        x = x.unflatten(-1, (-1, fmt.group_size))
    if fmt.scale_dtype == torch.float16:  # the stored scale is what quantizes: round it first
        return torch.clamp(x.abs().amax(dim=-1) / fmt.qmax, F16_SCALE_FLOOR, F16_SCALE_MAX).half().float()
    return torch.clamp(x.abs().amax(dim=-1) / fmt.qmax, min=SCALE_FLOOR)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 2n]`` in ``[-8, 7]`` (any integer or integral float dtype) → ``[..., n]``
    uint8: element ``2j`` + 8 in the low nibble, ``2j + 1`` + 8 in the high one."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[..., n]`` uint8 → ``[..., 2n]`` int8 codes in ``[-8, 7]``."""
    lo = (packed & 0xF).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def scaled(values: torch.Tensor, scales: torch.Tensor, divide: bool = False) -> torch.Tensor:
    """``values × scale`` (or ``/ scale``) per (token, head) or per group of channels.

    Args:
        values: ``[..., head_dim]``; scales: ``[...]`` (one per head) or ``[..., G]`` (grouped:
            ``head_dim // G`` consecutive channels share a scale), same dtype as values.
    """
    if scales.dim() < values.dim():
        return values / scales[..., None] if divide else values * scales[..., None]
    v = values.unflatten(-1, (scales.shape[-1], -1))
    return (v / scales[..., None] if divide else v * scales[..., None]).flatten(-2)


def quantize(x: torch.Tensor, scales: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """Codes of ``x / scale``, clamped to ``±qmax`` and rounded to nearest, ties to even, on the
    grid (equal to ``clamp(x / scale, ±qmax).to(fmt.dtype)`` for fp8, ``torch.round`` for int8).

    Args:
        x: ``[T, num_kv_heads, head_dim]`` float; scales: ``[T, num_kv_heads]`` float32
            (``[T, num_kv_heads, G]`` for a grouped format).
    Returns:
        ``[T, num_kv_heads, head_dim]`` in ``fmt.dtype`` (int4: ``[..., head_dim // 2]`` uint8,
        :func:`pack_int4`).
    """
    y = torch.clamp(scaled(x.float(), scales, divide=True), -fmt.qmax, fmt.qmax)
    if fmt.is_fp8:
        q = fp8_quantum(y, fmt)
        return (round_half_even(y / q) * q).to(fmt.dtype)
    if fmt.packed:
        return pack_int4(round_half_even(y))
    return round_half_even(y).to(fmt.dtype)


def to_residual(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K in the residual's 16-bit ``dtype`` (float16: clamped to ±65504 first, no inf)."""
    if dtype == torch.float16:
        k = torch.clamp(k, -F16_SCALE_MAX, F16_SCALE_MAX)
    return k.to(dtype)


def quantize_k_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI K: per (block, KV head, channel) asymmetric 4-bit over the block's tokens.

    Args:
        x: ``[n, block_size, kv_heads, head_dim]`` full blocks of K (16-bit residual values).
    Returns:
        ``(codes, scale, zero)``: codes ``[n, block_size, kv_heads, head_dim // 2]`` uint8
        (:func:`pack_int4` of ``code - 8``, codes ``0..15``); scale = ``(max - min) / 15`` clamped
        to ``[2^-14, 65504]`` and zero = ``min`` clamped to ±65504, both ``[n, kv_heads, head_dim]``
        rounded to float16 first; code = ``round((x - zero) / scale)`` (ties to even) clamped to ``[0, 15]``.
    """
    xf = x.float()
    lo, hi = xf.amin(dim=1), xf.amax(dim=1)
    scale = torch.clamp((hi - lo) / 15, F16_SCALE_FLOOR, F16_SCALE_MAX).half()
    zero = torch.clamp(lo, -F16_SCALE_MAX, F16_SCALE_MAX).half()
    q = torch.clamp(round_half_even((xf - zero.float()[:, None]) / scale.float()[:, None]), 0, 15)
    return pack_int4(q - 8), scale, zero


def dequantize_k_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``code × scale + zero`` in ``dtype``: codes ``[..., T, kv_heads, head_dim // 2]`` uint8 and
    scale / zero ``[..., kv_heads, head_dim]`` (broadcast over the ``T`` tokens) → ``[..., T,
    kv_heads, head_dim]``."""
    c = (unpack_int4(codes).to(dtype) + 8)
    return c * scale.to(dtype).unsqueeze(-3) + zero.to(dtype).unsqueeze(-3)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes · scale`` computed in ``dtype`` (float32 by default, float64 for oracles).

    Args:
        codes: ``[..., head_dim]`` int8 / fp8, or ``[..., head_dim // 2]`` uint8 (packed int4);
            scales: ``[...]`` float32, or ``[..., G]`` for a grouped format.
    Returns:
        ``[..., head_dim]`` in ``dtype``.
    """
    if codes.dtype == torch.uint8:
        codes = unpack_int4(codes)
    return scaled(codes.to(dtype), scales.to(dtype))


def quantize_dequantize(x: torch.Tensor, fmt: KVCacheFormat, static_scale: float | None = None) -> torch.Tensor:
    """Fake quantization (what reading the stored K/V gives back), in x's dtype.

    Args:
        x: ``[..., num_kv_heads, head_dim]`` float.
    """
    if not fmt.quantized:  # auto: unrounded; float16 / bfloat16: rounded once to that dtype
        return x if fmt.dtype is None else x.to(fmt.dtype).to(x.dtype)
    flat = x.reshape(-1, *x.shape[-2:])
    if static_scale is None:
        s = compute_scales(flat, fmt)
    else:
        s = torch.full(flat.shape[:2], static_scale, device=x.device)
    return dequantize(quantize(flat, s, fmt), s).to(x.dtype).reshape(x.shape)
