"""Dense bfloat16 linears on Intel AMX tiles (``kernels/native/amx_linear.c``), the CPU's layer
matmuls where the tile unit is there.

:func:`llmd.quant.prepacked.prepack_model` packs a bfloat16 model's layer weights once, either for
oneDNN (its blocked layout) or, when :func:`install` has registered :func:`linear`, into the tile
order of ``amx_linear.c`` (:func:`llmd.quant.prepacked.amx_pack`: the same bytes, no second copy).
The kernel streams each weight once per call and keeps no per-shape state, where oneDNN's
``brgemm`` builds a primitive per row count and at decode row counts reads the weights at ~60 % of
this machine's bandwidth. Measured on the 2-core AMX Xeon (2026-12-07, SmolLM2's 120 layer
matmuls, random weights from memory, ms for all of them, alternated in one process: oneDNN → AMX):
M = 8 12.3–12.7 → 8.7–8.8, M = 32 14.8–15.0 → 10.9–11.0, M = 64 16.5–17.7 → 13.2–14.1, M = 128
23.0–23.5 → 18.7–19.0, M = 512 63.6–65.6 → 59.0–60.4.

Numerics: exact bfloat16 products summed in float32 per 32-column step, rounded once to bfloat16:
equal to ``F.linear`` for most row counts and within one bfloat16 rounding of it for the others
(oneDNN changes its blocking with M); a row's output never depends on the other rows of the call
(``tests/kernels/test_tile_linears.py``). ``LLMD_AMX_LINEAR=0`` keeps oneDNN's packs (the A/B switch).
"""

from __future__ import annotations

import os

import torch

from llmd.kernels.native import build
from llmd.quant import prepacked


def available() -> bool:
    """The library is built with AMX, the OS grants the tile state, and ``LLMD_AMX_LINEAR`` is not ``0``."""
    if os.environ.get("LLMD_AMX_LINEAR", "1") == "0":
        return False
    lib = build.load_amx_linear()
    return lib is not None and lib.llmd_amx_linear_ready() == 1


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ W.T`` → ``[..., N]`` in x's dtype (computed in bfloat16), for ``w`` =
    :func:`llmd.quant.prepacked.amx_pack` of a bfloat16 ``W [N, K]`` (``uint16 [N, K]``).

    Raises:
        RuntimeError: the kernel refused the call (not granted the tile state, or a shape whose
            K or N is not a multiple of 32: :func:`llmd.quant.prepacked.amx_packable` keeps those out).
    """
    return product(build.load_amx_linear().llmd_amx_linear, "amx_linear", x, w)


def product(fn, name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Call a packed-weight kernel ``fn(x, ldx, w, y, M, K, N, threads) -> 0 | -1`` (``amx_linear.c``'s
    ``llmd_amx_linear`` or ``dp_linear.c``'s ``llmd_dp_linear``: the same signature and pack) on ``x
    [..., K]`` (any float dtype; rows with a stride are passed as they are) → ``[..., N]`` in x's dtype.

    Raises:
        RuntimeError: ``fn`` returned -1 (``name`` in the message), or ``x``'s last size is not K
            (the kernel would read K elements a row past a shorter row: out of bounds), as ``F.linear``.
    """
    n, k = w.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise RuntimeError(f"{name}: x of shape {list(x.shape)} for a [{n}, {k}] weight (in-features {k})")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype is not torch.bfloat16 or x2.stride(-1) != 1 or x2.stride(0) < k:
        x2 = x2.to(torch.bfloat16).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m and fn(x2.data_ptr(), x2.stride(0), w.data_ptr(), y.data_ptr(), m, k, n, torch.get_num_threads()):
        raise RuntimeError(f"{name}: the kernel refused a [{m}, {k}] x [{n}, {k}] product")
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], n)
    return y if x.dtype is torch.bfloat16 else y.to(x.dtype)


def install() -> bool:
    """Register :func:`linear` with :mod:`llmd.quant.prepacked` (which imports no kernels) when
    :func:`available`; returns whether it did, i.e. whether ``prepack_model`` packs for AMX."""
    if not available():
        return False
    prepacked.tile_linear, prepacked.tile_kernel = linear, "AMX tiles"
    prepacked.tile_pack, prepacked.tile_unpack = prepacked.amx_pack, prepacked.amx_unpack
    return True
