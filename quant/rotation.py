"""Per-head orthogonal rotations of K for quantized KV caches (``--kv-rotation``).

QuaRot (Ashkboos et al., arXiv:2404.00456) and SpinQuant: for an orthonormal ``H``
(``H Hᵀ = I``), ``(q H)·(k H) = q·k``, so rotating both the query and the key after RoPE leaves
every attention score unchanged in exact arithmetic while spreading an outlier channel of
``k`` over all ``head_dim`` channels: the per-(token, head) amax falls towards the rms, and so
does the quantization step ``amax / qmax``. Only K is rotated (``llmd.kernels.ops``): V could
be too, with the output rotated back (``softmax(s) (v H) Hᵀ = softmax(s) v``), but that
measured no better (README, "Quantized KV cache").

``hadamard``: the normalized Walsh-Hadamard matrix of order ``head_dim`` (Sylvester's
construction, ``H_{2n} = [[H, H], [H, -H]] / sqrt(2)``): symmetric and orthonormal, so it is
its own inverse (``H H = I``). Needs ``head_dim`` a power of two (64 for SmolLM2, 256 for
Gemma 3 270M). It is applied as a dense ``[head_dim, head_dim]`` matmul (``d²`` multiply-adds
per vector instead of the fast transform's ``d log d``: one small GEMM per layer is cheaper
than ``log d`` elementwise passes in torch).
"""

from __future__ import annotations

import functools

import torch

ROTATIONS = ("none", "hadamard")


def check_rotation(rotation: str, head_dim: int) -> None:
    """Raise ValueError (one line) for an unknown rotation or a head_dim it cannot rotate."""
    if rotation not in ROTATIONS:
        raise ValueError(f"--kv-rotation must be one of {', '.join(ROTATIONS)}, got {rotation!r}")
    if rotation == "hadamard" and (head_dim < 1 or head_dim & (head_dim - 1)):
        raise ValueError(f"--kv-rotation hadamard needs head_dim a power of two, got {head_dim} (use none)")


@functools.lru_cache(maxsize=16)
def _hadamard(head_dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / head_dim**0.5).to(dtype=dtype, device=device)


def hadamard(head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """The normalized Walsh-Hadamard matrix ``[head_dim, head_dim]`` in ``dtype`` on ``device``
    (built in float64, entries ``±head_dim^-1/2``; cached). Raises ValueError if head_dim is not
    a power of two."""
    check_rotation("hadamard", head_dim)
    return _hadamard(head_dim, dtype, str(device))


def rotate(x: torch.Tensor, rotation: str) -> torch.Tensor:
    """``x H`` over the last dim (``[..., head_dim]``, any float dtype; float16/bfloat16 are
    rotated in float32 and cast back). ``rotation`` "none" returns ``x`` itself. Since ``H`` is
    symmetric and orthonormal, ``rotate(rotate(x)) == x`` up to rounding."""
    if rotation == "none":
        return x
    cdt = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    return (x.to(cdt) @ hadamard(x.shape[-1], cdt, x.device)).to(x.dtype)
