"""Quantized KV cache formats (int8, fp8 e4m3 / e5m2, int4): scale layout and the torch reference.

Layout of one layer's paged cache (vLLM vocabulary: block, block_size, slot):

* ``data``:   ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in the storage dtype
  (index 0 = K, 1 = V): the model dtype for ``auto``, ``torch.int8``, ``torch.float8_e4m3fn``
  or ``torch.float8_e5m2`` for the 8-bit formats.
* ``scales``: ``[2, num_blocks, block_size, num_kv_heads]`` float32, only for 8-bit formats:
  one scale per (token, KV head) for K and for V, living beside the block's data at the same
  ``[block, offset]`` index, so a token at slot ``s`` has its scales at
  ``scales[:, s // block_size, s % block_size]``. Bytes per token per layer:
  ``2 · kv_heads · (head_dim + 4)``.
* ``int4`` (KIVI, arXiv:2402.02750; :attr:`KVCacheFormat.k_per_block`): data ``[2, num_blocks,
  block_size, num_kv_heads, head_dim // 2]`` uint8, two 4-bit codes per byte (element ``2j`` in
  the low nibble, ``2j + 1`` in the high one). **K per channel over the block's tokens**: per
  (block, KV head, channel) an asymmetric float16 scale ``(max - min) / 15`` and zero point
  ``min`` over the block's ``block_size`` tokens, codes ``0..15``, value ``code × scale + zero``.
  **V per token**: symmetric, a float16 scale per 16 channels, codes ``-7..7`` stored ``+ 8``.
  Scales ``[1, num_blocks, 2 · kv_heads · head_dim + block_size · kv_heads · head_dim / 16]``
  float16 per block: K's scales ``[kv_heads, head_dim]``, K's zero points, then V's
  ``[block_size, kv_heads, head_dim / 16]`` (views: :meth:`PagedKVCache.k_scale`, ``k_zero``,
  ``v_scale``). Scales and zero points are rounded to float16 *before* quantizing, so the codes
  are those of the stored values. A block's K is quantized once the block is full, from 16-bit
  values; until then (and for every query in the same block) K is read from the **residual**
  ``[R, block_size, num_kv_heads, head_dim]`` (bfloat16 for a bfloat16 model, else float16
  clamped to ±65504), one slot per (sequence, KV cache group) held by the KV manager. Bytes per
  token per layer at block 16: ``kv_heads · head_dim · 1.375`` (2.91× fewer than 16-bit) plus
  the residual.

On the CPU the two planes of ``data`` (and of 8-bit ``scales``) do not touch: the V plane starts
:func:`plane_stride` elements after the K plane, a gap of under 4 KiB chosen so that the planes lie
2 KiB apart modulo the 4 KiB page (:data:`PLANE_SKEW_BYTES`). Each plane is contiguous; the tensor
as a whole is not (``data.stride(0)`` ≥ one plane's elements; the C kernels take it as the K-to-V
distance). With the planes a whole number of pages apart, a slot's K and V rows, read one after
the other by the decode kernel, fall in the same L1/L2 cache sets: the batch-32 × 512 decode
attention (SmolLM2) took 1.09–1.26× longer in bfloat16 and 1.31× in int8 on a 2-core AMD EPYC
(Zen 4), measured side by side (``benchmarks/native_decode.py`` prints that ratio). int4 caches
(KIVI) keep one contiguous tensor.

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

The formats themselves (:class:`KVCacheFormat`, :data:`KV_CACHE_FORMATS`, :func:`get_format`) are
torch-free plain data in :mod:`llmd.quant.kv_format`, re-exported here.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from llmd.quant.kv_format import KV_CACHE_FORMATS, KVCacheFormat, get_format  # noqa: F401 (the formats, re-exported)

#: Smallest scale: an all-zero (token, head) vector gives scale 1e-8 and codes 0, never NaN.
SCALE_FLOOR = 1e-8
SCALE_DTYPE = torch.float32
#: float16 scales (int4): the smallest normal float16 (tinier groups quantize to 0) and the largest finite one
F16_SCALE_FLOOR, F16_SCALE_MAX = 2.0**-14, 65504.0


@dataclass
class PagedKVCache:
    """One layer's paged KV cache: data, optional scales, format (layout in the module docstring).

    Attributes:
        data: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` storage dtype
            (``head_dim // 2`` uint8 for int4).
        scales: ``[2, num_blocks, block_size, num_kv_heads]`` float32 (int4: float16 with a last
            dim of ``head_dim // 16`` groups), or None for ``auto``.
        fmt: the :class:`KVCacheFormat`.
        static_scales: (k_scale, v_scale) per-tensor scales, or None for dynamic scales.
        rotation: ``--kv-rotation`` ("none" or "hadamard", :mod:`llmd.quant.rotation`): the
            stored K is rotated; the attention ops rotate the query the same way.
        residual: int4 only: ``[R, block_size, num_kv_heads, head_dim]`` 16-bit, the exact K of
            each sequence's open block (slot per (sequence, KV cache group)), else None.
        new_keys: int4 only, transient: this step's K ``[T, num_kv_heads, head_dim]`` (rotated,
            16-bit) left by ``store_kv`` for ``paged_attention``, which stores them (it has the
            step's metadata: block tables, residual slots) before it reads; ``step_tails`` what
            that store returned (:func:`llmd.kernels.kivi.store_keys`), for this layer's reads.
    """

    data: torch.Tensor
    scales: torch.Tensor | None
    fmt: KVCacheFormat
    static_scales: tuple[float, float] | None = None
    rotation: str = "none"
    residual: torch.Tensor | None = None
    new_keys: torch.Tensor | None = None
    step_tails: list | None = None

    @classmethod
    def allocate(cls, shape: tuple[int, ...], fmt: KVCacheFormat, model_dtype: torch.dtype, device,
                 static_scales: tuple[float, float] | None = None, rotation: str = "none",
                 residual_slots: int = 0) -> "PagedKVCache":
        """Zeroed cache of ``shape = [2, num_blocks, block_size, num_kv_heads, head_dim]``
        (int4: with ``residual_slots`` residual slots). Raises ValueError if ``fmt`` cannot store
        this head_dim."""
        fmt.check_head_dim(shape[-1])
        data_shape = (*shape[:-1], fmt.code_dim(shape[-1]))
        data = (zeros if fmt.k_per_block else kv_planes)(data_shape, fmt.storage_dtype(model_dtype), device)
        if fmt.k_per_block:
            _, n, bs, heads, d = shape
            scales = zeros((1, n, fmt.block_scale_elems(d, heads, bs)), fmt.scale_dtype, device)
            res_dtype = getattr(torch, fmt.residual_dtype_name(model_dtype))
            residual = zeros((max(1, residual_slots), bs, heads, d), res_dtype, device)
            return cls(data, scales, fmt, None, rotation, residual)
        groups = (fmt.scale_groups(shape[-1]),) if fmt.group_size else ()
        scales = kv_planes((*shape[:-1], *groups), fmt.scale_dtype, device) if fmt.quantized else None
        return cls(data, scales, fmt, static_scales if fmt.quantized else None, rotation)

    def k_scale(self) -> torch.Tensor:
        """int4: K's per-channel scales ``[num_blocks, kv_heads, head_dim]`` float16 (a view)."""
        n, h, d = self.data.shape[1], self.data.shape[3], self.head_dim
        return self.scales[0, :, : h * d].view(n, h, d)

    def k_zero(self) -> torch.Tensor:
        """int4: K's per-channel zero points ``[num_blocks, kv_heads, head_dim]`` float16 (a view)."""
        n, h, d = self.data.shape[1], self.data.shape[3], self.head_dim
        return self.scales[0, :, h * d : 2 * h * d].view(n, h, d)

    def v_scale(self) -> torch.Tensor:
        """int4: V's per-token scales ``[num_blocks, block_size, kv_heads, head_dim // 16]`` float16."""
        n, bs, h, d = self.data.shape[1], self.data.shape[2], self.data.shape[3], self.head_dim
        return self.scales[0, :, 2 * h * d :].view(n, bs, h, self.fmt.scale_groups(d))

    @classmethod
    def wrap(cls, cache: "torch.Tensor | PagedKVCache") -> "PagedKVCache":
        """A plain ``[2, blocks, block_size, heads, head_dim]`` tensor is an ``auto`` cache."""
        return cache if isinstance(cache, PagedKVCache) else cls(cache, None, KV_CACHE_FORMATS["auto"])

    @property
    def block_size(self) -> int:
        return int(self.data.shape[2])

    @property
    def head_dim(self) -> int:
        """Channels per (token, KV head), unpacked."""
        return int(self.data.shape[-1]) * (2 if self.fmt.packed else 1)


#: CPU tensors of at least this many bytes are zeroed lazily by :func:`zeros`
LAZY_ZEROS_BYTES = 1 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU, one of :data:`LAZY_ZEROS_BYTES` or more lives in a
    private anonymous memory map: the kernel's zero pages, each materialized on its first write,
    so a 512 MiB pool costs no ``memset`` at start-up (0.15-0.5 s on 2 cores) and only the blocks
    used become resident. The values are the same zeros as ``torch.zeros`` (every reader sees 0
    in a block nobody wrote)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


#: Where the V plane of a CPU cache starts relative to the K plane, modulo :data:`PAGE_BYTES`
#: (see the module docstring). Measured on the Zen 4 (V plane offsets from a page multiple, batch
#: 32 × 512 decode): 512 B 0.87×, 1 KiB 0.84×, 2 KiB 0.83×, 3 KiB 0.92×, 4 KiB / 8 KiB / 32 KiB
#: 0.98–0.99× the aliased time.
PLANE_SKEW_BYTES = 2048
PAGE_BYTES = 4096


def plane_stride(shape: tuple[int, ...], dtype: torch.dtype, device) -> int:
    """Elements from the K plane to the V plane of a ``[2, *plane]`` cache tensor on ``device``:
    one plane's elements, plus on the CPU the gap that puts the V plane :data:`PLANE_SKEW_BYTES`
    past a page multiple from the K plane (the gap is < :data:`PAGE_BYTES`)."""
    plane = math.prod(shape[1:])
    if torch.device(device).type != "cpu":
        return plane
    gap = (PLANE_SKEW_BYTES - plane * dtype.itemsize) % PAGE_BYTES  # a multiple of the item size (≤ 8 B)
    return plane + gap // dtype.itemsize


def kv_planes(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-filled ``[2, *plane]`` tensor (K plane, V plane) whose planes are
    :func:`plane_stride` elements apart: contiguous on a GPU; on the CPU each plane is contiguous
    and the V plane is skewed by :data:`PLANE_SKEW_BYTES` modulo the page (memory: one plane
    twice plus under 4 KiB). Raises ValueError if ``shape[0] != 2``."""
    if shape[0] != 2:
        raise ValueError(f"kv_planes: shape {tuple(shape)} does not start with 2 planes")
    stride = plane_stride(shape, dtype, device)
    plane = math.prod(shape[1:])
    if stride == plane:
        return zeros(shape, dtype, device)
    inner = torch.empty(shape[1:], dtype=dtype, device="meta").stride()
    return zeros((stride + plane,), dtype, device).as_strided(shape, (stride, *inner))


def planes_contiguous(t: torch.Tensor) -> bool:
    """``t`` ``[2, ...]`` has each plane contiguous and the V plane wholly after the K plane (as
    :func:`kv_planes` makes them, or a contiguous tensor): the layout the C kernels read, with
    ``t.stride(0)`` the K-to-V distance in elements."""
    return t.dim() >= 2 and t.shape[0] == 2 and t[0].is_contiguous() and t.stride(0) >= t[0].numel()


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
