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

The CPU placement of the two planes (the V plane skewed 2 KiB modulo the page from the K plane)
and the lazily zeroed pools are :mod:`llmd.quant.kv_alloc`'s; the scales, quantization, rounding
and dequantization (the torch reference) are :mod:`llmd.quant.kv_codes`'s. Both are re-exported
here, so ``from llmd.quant.kv import ...`` reaches every name.

The formats themselves (:class:`KVCacheFormat`, :data:`KV_CACHE_FORMATS`, :func:`get_format`) are
torch-free plain data in :mod:`llmd.quant.kv_format`, re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmd.quant.kv_alloc import (  # noqa: F401 (re-exported)
    LAZY_ZEROS_BYTES,
    PAGE_BYTES,
    PLANE_SKEW_BYTES,
    kv_planes,
    plane_stride,
    planes_contiguous,
    zeros,
)
from llmd.quant.kv_codes import (  # noqa: F401 (re-exported)
    F16_SCALE_FLOOR,
    F16_SCALE_MAX,
    SCALE_DTYPE,
    SCALE_FLOOR,
    compute_scales,
    dequantize,
    dequantize_k_blocks,
    fp8_quantum,
    pack_int4,
    quantize,
    quantize_dequantize,
    quantize_k_blocks,
    round_half_even,
    scaled,
    to_residual,
    unpack_int4,
)
from llmd.quant.kv_format import KV_CACHE_FORMATS, KVCacheFormat, get_format  # noqa: F401 (the formats, re-exported)


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
