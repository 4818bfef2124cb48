"""Allocating the paged KV cache's tensors: lazily zeroed pools and skewed K/V planes.

:func:`zeros` hands out zero-filled tensors; on the CPU one of :data:`LAZY_ZEROS_BYTES` (1 MiB)
or more lives in a private anonymous memory map, so the kernel's zero pages are materialized on
first write and only the blocks used become resident. :func:`kv_planes` allocates a ``[2, *plane]``
tensor (index 0 = K, 1 = V; any dtype) whose planes are :func:`plane_stride` elements apart;
:func:`planes_contiguous` checks that layout. Raises ValueError for a shape without two planes.

On the CPU the two planes of a cache's ``data`` (and of 8-bit ``scales``) do not touch: the V plane starts
:func:`plane_stride` elements after the K plane, a gap of under 4 KiB chosen so that the planes lie
2 KiB apart modulo the 4 KiB page (:data:`PLANE_SKEW_BYTES`). Each plane is contiguous; the tensor
as a whole is not (``data.stride(0)`` ≥ one plane's elements; the C kernels take it as the K-to-V
distance). With the planes a whole number of pages apart, a slot's K and V rows, read one after
the other by the decode kernel, fall in the same L1/L2 cache sets: the batch-32 × 512 decode
attention (SmolLM2) took 1.09–1.26× longer in bfloat16 and 1.31× in int8 on a 2-core AMD EPYC
(Zen 4), measured side by side (``benchmarks/native_decode.py`` prints that ratio). int4 caches
(KIVI) keep one contiguous tensor.

Used by :meth:`llmd.quant.kv.PagedKVCache.allocate`; these names are re-exported by
:mod:`llmd.quant.kv`.
"""

from __future__ import annotations

import math
import mmap

import torch

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
