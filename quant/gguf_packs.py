"""GGUF weight blocks as the codes and scales torch's weight-only kernels take.

A GGUF 4-bit tensor stores blocks of 32 (or 256 = 8 × 32) weights along a row with one or
two half-precision parameters per 32; torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``,
the tinygemm format) computes with ``w = (q - 8) · scale + zero`` for codes ``q ∈ [0, 16)`` and
one ``(scale, zero)`` per group of 32 along K (verified against a float64 matmul in
``tests/quant/test_gguf_packs.py``). The formats map exactly (block layouts: ggml's
``ggml-quants.c``, read here as the ``gguf`` package's own dequantizers read them):

=======  ======================================  ===================================
type     GGUF value of code ``q``                  (scale, zero)
=======  ======================================  ===================================
Q4_0     ``(q - 8) · d``                           ``(d, 0)``
Q4_1     ``q · d + m``                             ``(d, m + 8 d)``
Q4_K     ``d · sc_j · q - dmin · m_j`` (sub-block j) ``(d sc_j, 8 d sc_j - dmin m_j)``
=======  ======================================  ===================================

Element order inside a block: Q4_0/Q4_1 hold element ``i`` in the low nibble of byte ``i``
and element ``i + 16`` in its high nibble; a Q4_K super-block holds sub-blocks ``2j`` and
``2j + 1`` in the low and high nibbles of bytes ``[32j, 32j + 32)``.

Q8_0 (``q · d``, int8 codes, one d per 32) has no grouped int8 kernel in torch; it is
re-quantized per output row (symmetric, absmax / 127) for ``_weight_int8pack_mm``.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

GROUP = 32  # the int4 kernels' group size, and every 4-bit GGUF type's sub-block
INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
INT8_TYPES = frozenset({T.Q8_0})


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes → ``[..., 32]`` codes: the 16 low nibbles, then the 16 high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def int4_codes(raw: np.ndarray, ggml_type: T, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes and group parameters of a Q4_0 / Q4_1 / Q4_K tensor.

    Args:
        raw: the tensor's bytes (``uint8``, any shape; ``GGUFReader`` tensor ``data``).
        ggml_type: one of :data:`INT4_TYPES`.
        rows, cols: the weight's ``[out_features, in_features]`` (``cols`` a multiple of 32).
    Returns:
        ``codes`` uint8 ``[rows, cols]`` in ``[0, 16)``, ``scale`` and ``zero`` float32
        ``[rows, cols // 32]``, with ``w = (codes - 8) · scale + zero`` equal to
        ``gguf.quants.dequantize`` up to float32 rounding.
    Raises:
        ValueError: another type, or a shape the bytes do not fill.
    """
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if ggml_type == T.Q4_0:
        b = raw.reshape(rows, cols // 32, 18)
        d = _f16(b[..., :2])[..., 0]
        return _nibbles(b[..., 2:]).reshape(rows, cols), d, np.zeros_like(d)
    if ggml_type == T.Q4_1:
        b = raw.reshape(rows, cols // 32, 20)
        d, m = _f16(b[..., :2])[..., 0], _f16(b[..., 2:4])[..., 0]
        return _nibbles(b[..., 4:]).reshape(rows, cols), d, m + 8.0 * d
    if ggml_type == T.Q4_K:
        b = raw.reshape(rows * cols // 256, 144)
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])  # [n, 1]
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # [n, 8] sub-block scales/mins
        scale = d * sc.astype(np.float32)
        zero = 8.0 * scale - dmin * mn.astype(np.float32)
        qs = b[:, 16:].reshape(-1, 4, 32)  # 4 pairs of sub-blocks
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2)  # [n, 4, 2, 32]: sub-blocks 2j, 2j+1
        return codes.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1)
    raise ValueError(f"{ggml_type.name} is not a 4-bit GGUF type with 32-element groups")


def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8 of a float32 ``[rows, cols]`` weight.

    Returns ``codes`` int8 ``[rows, cols]`` and ``scale`` float32 ``[rows]`` with
    ``w ≈ codes · scale[:, None]`` (``scale = absmax / 127``; an all-zero row gets scale 1).
    """
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    codes = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return codes, scale
