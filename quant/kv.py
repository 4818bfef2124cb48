"""Quantized KV cache formats (int8, fp8 e4m3 / e5m2): scale layout and the torch reference.

Layout of one layer's paged cache (vLLM vocabulary: block, block_size, slot):

* ``data``:   ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in the storage dtype
  (index 0 = K, 1 = V): the model dtype for ``auto``, ``torch.int8``, ``torch.float8_e4m3fn``
  or ``torch.float8_e5m2`` for the 8-bit formats.
* ``scales``: ``[2, num_blocks, block_size, num_kv_heads]`` float32, only for 8-bit formats:
  one scale per (token, KV head) for K and for V, living beside the block's data at the same
  ``[block, offset]`` index, so a token at slot ``s`` has its scales at
  ``scales[:, s // block_size, s % block_size]``. Bytes per token per layer:
  ``2 · kv_heads · (head_dim + 4)``.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Smallest scale: an all-zero (token, head) vector gives scale 1e-8 and codes 0, never NaN.
SCALE_FLOOR = 1e-8
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVCacheFormat:
    """One ``--kv-cache-dtype``.

    Attributes:
        name: "auto", "int8", "fp8_e4m3" or "fp8_e5m2".
        dtype: storage dtype, None for ``auto`` (the model dtype).
        qmax: largest magnitude of a code (127, 448, 57344); 0 for ``auto``.
        mantissa_bits, min_exponent: fp8 grid (3, -6 for e4m3fn; 2, -14 for e5m2); 0 for int8.
    """

    name: str
    dtype: torch.dtype | None
    qmax: float = 0.0
    mantissa_bits: int = 0
    min_exponent: int = 0

    @property
    def quantized(self) -> bool:
        return self.dtype is not None

    @property
    def is_fp8(self) -> bool:
        return self.mantissa_bits > 0

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None else model_dtype

    def bytes_per_element(self, model_dtype: torch.dtype) -> int:
        return torch.empty(0, dtype=self.storage_dtype(model_dtype)).element_size()

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per (token, KV head) for each of K and V (0 for ``auto``)."""
        return 4 if self.quantized else 0


KV_CACHE_FORMATS: dict[str, KVCacheFormat] = {
    "auto": KVCacheFormat("auto", None),
    "int8": KVCacheFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 3, -6),
    "fp8_e5m2": KVCacheFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 2, -14),
}


def get_format(name: str) -> KVCacheFormat:
    """Format by ``--kv-cache-dtype`` name. Raises ValueError listing the choices."""
    try:
        return KV_CACHE_FORMATS[name]
    except KeyError:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_FORMATS)}, got {name!r}") from None


@dataclass
class PagedKVCache:
    """One layer's paged KV cache: data, optional scales, format (layout in the module docstring).

    Attributes:
        data: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` storage dtype.
        scales: ``[2, num_blocks, block_size, num_kv_heads]`` float32, or None for ``auto``.
        fmt: the :class:`KVCacheFormat`.
        static_scales: (k_scale, v_scale) per-tensor scales, or None for dynamic scales.
    """

    data: torch.Tensor
    scales: torch.Tensor | None
    fmt: KVCacheFormat
    static_scales: tuple[float, float] | None = None

    @classmethod
    def allocate(cls, shape: tuple[int, ...], fmt: KVCacheFormat, model_dtype: torch.dtype, device,
                 static_scales: tuple[float, float] | None = None) -> "PagedKVCache":
        """Zeroed cache of ``shape = [2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        data = torch.zeros(shape, dtype=fmt.storage_dtype(model_dtype), device=device)
        scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if fmt.quantized else None
        return cls(data, scales, fmt, static_scales if fmt.quantized else None)

    @classmethod
    def wrap(cls, cache: "torch.Tensor | PagedKVCache") -> "PagedKVCache":
        """A plain ``[2, blocks, block_size, heads, head_dim]`` tensor is an ``auto`` cache."""
        return cache if isinstance(cache, PagedKVCache) else cls(cache, None, KV_CACHE_FORMATS["auto"])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[2])


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
        ``[T, num_kv_heads]`` float32.
    """
    amax = x.float().abs().amax(dim=-1)
    return torch.clamp(amax / fmt.qmax, min=SCALE_FLOOR)


def quantize(x: torch.Tensor, scales: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """Codes of ``x / scale``, clamped to ``±qmax`` and rounded to nearest, ties to even, on the
    grid (equal to ``clamp(x / scale, ±qmax).to(fmt.dtype)`` for fp8, ``torch.round`` for int8).

    Args:
        x: ``[T, num_kv_heads, head_dim]`` float; scales: ``[T, num_kv_heads]`` float32.
    Returns:
        ``[T, num_kv_heads, head_dim]`` in ``fmt.dtype``.
    """
    y = torch.clamp(x.float() / scales[..., None], -fmt.qmax, fmt.qmax)
    if fmt.is_fp8:
        q = fp8_quantum(y, fmt)
        return (round_half_even(y / q) * q).to(fmt.dtype)
    return round_half_even(y).to(fmt.dtype)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes · scale`` computed in ``dtype`` (float32 by default, float64 for oracles).

    Args:
        codes: ``[..., head_dim]`` int8 / fp8; scales: ``[...]`` float32.
    """
    return codes.to(dtype) * scales.to(dtype)[..., None]


def quantize_dequantize(x: torch.Tensor, fmt: KVCacheFormat, static_scale: float | None = None) -> torch.Tensor:
    """Fake quantization (what reading the stored K/V gives back), in x's dtype.

    Args:
        x: ``[..., num_kv_heads, head_dim]`` float.
    """
    if not fmt.quantized:
        return x
    flat = x.reshape(-1, *x.shape[-2:])
    s = compute_scales(flat, fmt) if static_scale is None else torch.full(flat.shape[:2], static_scale, device=x.device)
    return dequantize(quantize(flat, s, fmt), s).to(x.dtype).reshape(x.shape)
