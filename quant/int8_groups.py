"""Symmetric int8 weights with one scale per 32 input columns (Q8_0's grid), for CPU ``--weight-quant int8``.

Codes (:func:`quantize`): ``w [N, K] ≈ codes · scale`` per group of :data:`GROUP` = 32 along K,
``scale[n, g] = absmax / 127`` over the group (an all-zero group gets scale 1), ``codes`` int8
in ±127. A bfloat16 model rounds each scale *up* to the next bfloat16 value before quantizing
(:func:`bf16_ceil`), so the codes stay within ±127 and the kernels' bfloat16 scales are exact.

Kernels (:func:`linear`; torch has no grouped int8 CPU kernel):

* bfloat16, ``M <= small_batch`` rows: the *nibble split* over torch's int4 CPU kernel
  ``_weight_int4pack_mm_for_cpu``, which computes ``w = (q - 8) · scale + zero`` per group of 32
  (the formula :mod:`llmd.quant.gguf_packs` maps GGUF's 4-bit blocks onto; this trick is
  derived from it). With ``u = code + 128 ∈ [1, 255] = 16 · hi + lo``:
  ``s · code = [16 s · (hi - 8) + 0] + [s · (lo - 8) + 8 s]``, two int4 rows per weight row
  with scales_zeros ``(16 s, 0)`` and ``(s, 8 s)`` (exact in bfloat16: powers-of-two multiples of
  a bfloat16 ``s``); one kernel call over the ``2N`` rows, then the row pairs are summed
  (:func:`pack` places them so that every byte of the pack is ``u`` itself). Bytes: ``N · K``
  (as many as the int8 codes) plus 8 per group.
* bfloat16, more rows: the codes are read back from that pack (a xor: :func:`dequantize`; the
  pack layout is torch's CPU one, probed once per process by :func:`pack_block`), dequantized
  to bfloat16, and a dense matmul (oneDNN) runs (where the probe finds no known layout, the
  kernel serves every batch). Weights with ``N % 32 != 0`` keep the codes as they are (bfloat16
  scales) and take the dequantizing path for every batch.
* float32 (any ``M``): the int8 codes ``[N, K]`` and float32 scales ``[N, K/32]`` are kept;
  each call dequantizes them (exact: codes · s in float32) and runs ``F.linear``; torch's float32
  ``_weight_int8pack_mm`` is slower, and its int4 kernel on float32 activations ~30× slower than
  on bfloat16 (README "Weights").

Dequantization goes through a per-thread workspace of at most :data:`CHUNK` weights (rows in
chunks), so no dense copy outlives a call.

Measured (SmolLM2's 1536 × 576 up-projection, README "Weights" for the 30-layer figures):
M = 1 bfloat16 nibble split 74-89 µs vs per-row int8 38-56 µs vs dense 85-235 µs.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch
import torch.nn.functional as F

GROUP = 32
CHUNK = 1 << 20  # weights dequantized at a time (4 MiB in float32): the workspace's size
_local = threading.local()


def bf16_ceil(s: torch.Tensor) -> torch.Tensor:
    """Float32 ``s`` (positive) → the smallest bfloat16-representable values ``>= s``, as float32."""
    r = s.to(torch.bfloat16)
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    return torch.where(r.float() < s, up, r).float()


def quantize(w: np.ndarray | torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``w [N, K]`` (K a multiple of 32) → ``codes`` int8 ``[N, K]`` in ±127 and
    ``scale`` float32 ``[N, K/32]`` with ``w ≈ codes · scale`` per group (bfloat16-exact scales
    when ``dtype`` is bfloat16)."""
    w = torch.as_tensor(w, dtype=torch.float32)
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int8 groups need K % {GROUP} == 0, got K = {k}")
    g = w.reshape(n, k // GROUP, GROUP)
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    if dtype == torch.bfloat16:
        scale = bf16_ceil(scale)
    codes = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scale


@functools.lru_cache(maxsize=None)
def pack_block() -> int:
    """Rows per block of torch's CPU int4 pack on this machine, found by packing a probe: within
    each block of B rows and for each column, byte j holds row j in its low nibble and row
    ``j + B/2`` in its high one (B = 64 with AVX-512, 32 with AVX2); 0 when neither reproduces it."""
    probe = torch.arange(128 * 64, dtype=torch.int32).view(128, 64) % 16
    p = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    for b in (64, 32):
        q = p.view(128 // b, 64, b // 2)
        if torch.equal(torch.cat([q & 15, q >> 4], dim=-1).transpose(1, 2).reshape(128, 64).to(torch.int32), probe):
            return b
    return 0


def _half() -> int:
    """Rows of one nibble half in a block of the nibble-split pack (see :func:`pack`)."""
    return pack_block() // 2 or 32


def pack(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``codes`` int8 ``[N, K]`` and ``scale`` float32 ``[N, K/32]`` (from :func:`quantize`) →
    ``(packed, scales)`` for :func:`linear`.

    bfloat16 with ``N % 32 == 0``: the nibble-split pack of ``2N`` rows, ``[2N, K/2]`` uint8, and
    scales_zeros ``[K/32, 2N, 2]`` bfloat16. Block ``b`` of the pack holds, in its rows
    ``[0, H)``, the ``lo`` nibbles of weight rows ``[bH, bH + H)`` (scale, zero ``(s, 8 s)``)
    and in its rows ``[H, 2H)`` their ``hi`` nibbles (``(16 s, 0)``), with H = B/2 of
    :func:`pack_block` (32 where the probe found no layout), so each byte of the pack is
    ``u = 16 hi + lo = code + 128`` itself. Otherwise: the
    codes as they are and the scales in ``dtype``, ``[N, K/32]``.
    """
    n, k = codes.shape
    if dtype != torch.bfloat16 or n % 32:
        return codes.contiguous(), scale.to(dtype).contiguous()
    half = _half()
    u = (codes.to(torch.int32) + 128).view(n // half, 1, half, k)
    rows = torch.cat([u & 15, u >> 4], dim=1).reshape(2 * n, k)  # per block: H lo rows, then H hi rows
    packed = torch._convert_weight_to_int4pack_for_cpu(rows.contiguous(), 1)
    s = scale.to(torch.bfloat16).t().reshape(k // GROUP, n // half, 1, half)  # exact (bf16_ceil)
    lo = torch.stack([s, s * 8], dim=-1)
    hi = torch.stack([s * 16, torch.zeros_like(s)], dim=-1)
    return packed, torch.cat([lo, hi], dim=2).reshape(k // GROUP, 2 * n, 2).contiguous()


def dequantize(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
               rows: slice = slice(None)) -> torch.Tensor:
    """The weight ``codes · scale`` of :func:`pack`'s output, its ``rows``, in the scales' dtype.

    Codes-and-scales packs: ``[rows, K]`` (into ``out`` when given). Nibble-split packs: the
    transpose, ``[K, rows]``, the layout the unpack gives (each pack byte is ``code + 128``,
    block by block: ``[2N/B, K, H]`` bytes → ``[K, N]``); ``rows`` must be whole blocks (multiples
    of H).

    Raises:
        ValueError: a nibble-split pack where :func:`pack_block` found no layout."""
    if packed.dtype != torch.uint8:
        codes, scale = packed[rows], scales[rows]
        n, k = codes.shape
        g = k // GROUP
        w = out.view(n, g, GROUP) if out is not None else torch.empty(n, g, GROUP, dtype=scale.dtype)
        return w.copy_(codes.view(n, g, GROUP)).mul_(scale[..., None]).view(n, k)
    if not pack_block():
        raise ValueError("torch's CPU int4 pack layout is not the probed one: a nibble pack cannot be unpacked")
    half = _half()
    k = 2 * packed.shape[1]
    r0, r1, _ = rows.indices(packed.shape[0] // 2)
    n, g = r1 - r0, k // GROUP
    u = packed[2 * r0:2 * r1].view(n // half, k, half)
    w = out.view(k, n // half, half) if out is not None else torch.empty(k, n // half, half, dtype=scales.dtype)
    w.copy_((u ^ 128).view(torch.int8).transpose(0, 1))
    s = scales[:, 2 * r0:2 * r1, 0].reshape(g, n // half, 2, half)[:, :, 0].reshape(g, 1, n)  # the lo rows' s
    return w.view(g, GROUP, n).mul_(s).view(k, n)


def _workspace(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread scratch buffer of at least ``numel`` elements (reused: no page faults per call),
    one per dtype and inference mode (a buffer made under ``torch.inference_mode`` cannot be
    written outside it)."""
    bufs = _local.__dict__.setdefault("bufs", {})
    key = dtype, torch.is_inference_mode_enabled()
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _dequantized_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (codes · s)ᵀ`` through dequantization, about :data:`CHUNK` weights at a time."""
    nibbles = packed.dtype == torch.uint8
    n, k = (packed.shape[0] // 2, 2 * packed.shape[1]) if nibbles else packed.shape
    step = max(64, CHUNK // k // 64 * 64)  # whole pack blocks
    y = None if step >= n else torch.empty(x.shape[0], n, dtype=x.dtype)
    for r0 in range(0, n, step):
        rows = slice(r0, min(r0 + step, n))
        w = dequantize(packed, scales, _workspace((rows.stop - r0) * k, x.dtype), rows)
        part = torch.mm(x, w) if nibbles else F.linear(x, w)
        if y is None:
            return part
        y[:, rows] = part
    return y


def linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, small_batch: int) -> torch.Tensor:
    """``x [M, K]`` (the scales' dtype) → ``[M, N]``: the nibble-split kernel for a nibble pack
    and ``M <= small_batch`` (the two halves' outputs, each rounded to bfloat16, summed), else
    dequantize + a dense matmul."""
    if packed.dtype != torch.uint8 or x.shape[0] > small_batch and pack_block():
        return _dequantized_linear(x, packed, scales)
    half = _half()
    y2 = torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales)  # [M, 2N]
    return y2.view(x.shape[0], -1, 2, half).sum(2).view(x.shape[0], -1)
