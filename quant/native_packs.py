"""GGUF weight blocks in the layout of llmd's fused single-stream decode kernel
(``kernels/native/fused_decode.c``, which documents it; read by :mod:`llmd.kernels.cpu_fused`).

Two kinds, both keeping the file's own values (ggml's block formats, ``ggml-quants.c``), laid out
in tiles of 16 output rows so that one 16-lane VNNI accumulator holds a tile's 16 dot products (lane
``j`` = row ``j``): per tile, per block of 32 along K, the block's codes in *steps* of 4 (``vpdpbusd``
adds 4 byte products per lane), step ``s`` holding codes ``4s .. 4s + 3`` of each of the 16 rows.

* **Q4** ``(codes, scales, mins)``: ``w = code · scale + min`` per block of 32 (codes 0..15). Per
  (tile, block) 256 bytes: 4 chunks of 64, chunk ``c`` = row ``j``'s codes of step ``c`` in the low
  nibbles and of step ``c + 4`` in the high nibbles of bytes ``4j .. 4j + 3``. From Q4_0
  (``scale = d``, ``min = -8 d``), Q4_1 (``d``, ``m``: exact) and Q4_K (``d · sc_j``, ``-dmin ·
  m_j`` rounded to float16: relative error ≤ 2⁻¹¹ on each, far below the 4-bit step).
* **Q8** ``(codes, scales)``: ``w = code · scale`` (Q8_0, exact). Per (tile, block) 512 bytes: 8
  steps of 64, step ``s`` = row ``j``'s codes ``4s .. 4s + 3`` at bytes ``4j .. 4j + 3`` (int8).

``scales``/``mins`` are float16 ``[tiles, K/32, 16]``. The tensors keep the shapes ``codes``
``[N, K/2]`` uint8 (Q4) / ``[N, K]`` int8 (Q8) and ``[N, K/32]`` for the scales (their bytes in the
tile order above), so ``shape[0]`` is N. :func:`unpack` and :func:`dequantize` map them back (tests,
and the exactness check against ``gguf.quants.dequantize``). Needs N a multiple of 16 and K of 32.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

Q4, Q8 = "q4", "q8"


ROWS = 16  # rows per tile (fused_decode.c's ROWS)


def _tiles_scales(v: np.ndarray) -> torch.Tensor:
    """``[N, K/32]`` float → float16 in tile order ``[tiles, K/32, 16]`` (shaped ``[N, K/32]``)."""
    n, nb = v.shape
    t = np.ascontiguousarray(v.astype(np.float16).reshape(n // ROWS, ROWS, nb).transpose(0, 2, 1))
    return torch.from_numpy(t.reshape(n, nb))


def _check(n: int, k: int) -> None:
    if n % ROWS or k % 32:
        raise ValueError(f"native packs need N % {ROWS} == 0 and K % 32 == 0, got [{n}, {k}]")


def q4_pack(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> tuple[torch.Tensor, ...]:
    """The Q4 pack of ``w = (codes - 8) · scale + zero`` (:func:`llmd.quant.gguf_packs.int4_codes`'s
    form): ``codes`` ``[N, K]`` integers in ``[0, 16)`` (any dtype), ``scale``/``zero`` float32
    ``[N, K/32]``. Raises ValueError for N not a multiple of 16 or K of 32."""
    n, k = codes.shape
    _check(n, k)
    c = np.asarray(codes, dtype=np.uint8).reshape(n // ROWS, ROWS, k // 32, 2, 4, 4)  # tile, row, block, half, step, i
    packed = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [tile, row, block, chunk, i]
    packed = np.ascontiguousarray(packed.transpose(0, 2, 3, 1, 4)).reshape(n, k // 2)  # [tile, block, chunk, row, i]
    mins = zero.astype(np.float32) - 8.0 * scale.astype(np.float32)
    return torch.from_numpy(packed), _tiles_scales(scale), _tiles_scales(mins)


def q8_blocks(raw: np.ndarray, ggml_type: T, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's bytes (``GGUFReader`` tensor ``data``, ``[rows, cols]``) as row-major int8
    ``codes [rows, cols]`` and float32 ``scales [rows, cols / 32]`` (exact). Raises ValueError for
    another type."""
    if ggml_type != T.Q8_0:
        raise ValueError(f"Q8 pack reads Q8_0 blocks, got {ggml_type.name}")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // 32, 34)
    scales = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    return np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, cols), scales


def q8_pack(codes: np.ndarray, scales: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q8 pack of row-major int8 ``codes [N, K]`` and float ``scales [N, K/32]`` (``w = code ·
    scale``; :func:`q8_blocks` reads them from a file). Raises ValueError for N not a multiple of
    16 or K of 32."""
    n, k = codes.shape
    _check(n, k)
    c = np.asarray(codes, dtype=np.int8).reshape(n // ROWS, ROWS, k // 32, 8, 4)  # tile, row, block, step, i
    return torch.from_numpy(np.ascontiguousarray(c.transpose(0, 2, 3, 1, 4)).reshape(n, k)), _tiles_scales(scales)


def _untile_scales(t: torch.Tensor) -> torch.Tensor:
    n, nb = t.shape
    return t.reshape(n // ROWS, nb, ROWS).transpose(1, 2).reshape(n, nb).float()


def unpack(kind: str, pack: tuple[torch.Tensor, ...]):
    """A pack in row order: ``(codes [N, K] int32, scales [N, K/32] float32, mins [N, K/32] float32
    or None)``."""
    codes = pack[0]
    n = codes.shape[0]
    if kind == Q8:
        k = codes.shape[1]
        c = codes.reshape(n // ROWS, k // 32, 8, ROWS, 4).permute(0, 3, 1, 2, 4).reshape(n, k)
        return c.to(torch.int32), _untile_scales(pack[1]), None
    k = codes.shape[1] * 2
    b = codes.reshape(n // ROWS, k // 32, 4, ROWS, 4).permute(0, 3, 1, 2, 4)  # [tile, row, block, chunk, i]
    c = torch.stack((b & 0x0F, b >> 4), 3)  # [tile, row, block, half, chunk, i]: step = 4 half + chunk
    return c.reshape(n, k).to(torch.int32), _untile_scales(pack[1]), _untile_scales(pack[2])


def dequantize(kind: str, pack: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A pack's weights as float32 ``[N, K]``."""
    codes, scales, mins = unpack(kind, pack)
    n = codes.shape[0]
    w = codes.float().view(n, -1, 32) * scales[..., None]
    return (w if mins is None else w + mins[..., None]).flatten(1)


def nbytes(pack: tuple[torch.Tensor, ...]) -> int:
    """Bytes a pack holds."""
    return sum(t.nbytes for t in pack)
