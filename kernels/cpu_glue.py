"""A bfloat16 layer's elementwise passes in C on the CPU: RMSNorm, NEOX RoPE, SwiGLU's
``silu(gate) * up`` (``kernels/native/layer_glue.c``, which documents their numerics: the roundings
of torch's bfloat16 ops; RoPE bit for bit, the norm and SiLU within one bfloat16 ulp on rare
elements).

Each function returns None when it does not apply (not bfloat16, not on the CPU, a layout it does
not take, the library unavailable, or :data:`active` off), and the caller runs its torch ops.
:data:`active` is set by the model runner before every forward from its ``native_kernels``
choice (``--disable-native-kernels`` turns the glue off with the other C kernels), so engines with
different choices may share one loaded model (one forward at a time per process, as the engine
loop runs them).
"""

from __future__ import annotations

import torch

from llmd.kernels.native import build

active = False  # set per forward by the model runner (ModelRunner.execute)


def _lib():
    return build.load_glue() if active else None


def _rows(x: torch.Tensor, dim: int) -> tuple[int, int] | None:
    """``(rows, row stride)`` of ``x`` viewed as ``[rows, dim]`` with contiguous rows, else None."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.stride(-1) != 1 or x.shape[-1] != dim:
        return None
    if x.dim() == 2:
        return x.shape[0], x.stride(0)
    if x.is_contiguous():
        return x.numel() // dim, dim
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight · x / sqrt(mean(x²) + eps)`` over the last dim (HF LlamaRMSNorm in bfloat16):
    ``x [..., dim]`` bfloat16, ``weight [dim]`` bfloat16 contiguous → a new contiguous tensor of
    x's shape, or None (see the module docstring)."""
    dim = weight.shape[0]
    shape = _rows(x, dim)
    lib = _lib() if shape is not None and weight.dtype == torch.bfloat16 and weight.is_contiguous() else None
    if lib is None:
        return None
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    lib.llmd_rms_norm_bf16(x.data_ptr(), shape[1], weight.data_ptr(), shape[0], dim, eps, out.data_ptr(),
                           torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """NEOX rotate-half RoPE (:func:`llmd.models.layers.apply_rope`, bit for bit): ``x [T, heads,
    head_dim]`` bfloat16 with heads and channels contiguous (rows may be strided, e.g. a slice of
    the fused QKV output), ``cos`` / ``sin`` ``[T, 1, head_dim]`` bfloat16 (sin's first half
    negated) → ``[T, heads, head_dim]`` contiguous, or None."""
    if x.dim() != 3 or x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return None
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or d % 2:
        return None
    if cos.shape != (t, 1, d) or sin.shape != (t, 1, d):
        return None
    tables = [c[:, 0] for c in (cos, sin)]  # [T, d] views: rows of d contiguous, any row stride
    if any(c.dtype != torch.bfloat16 or c.stride(1) != 1 for c in tables):
        return None
    lib = _lib()
    if lib is None:
        return None
    out = torch.empty((t, heads, d), dtype=torch.bfloat16)
    lib.llmd_rope_bf16(x.data_ptr(), x.stride(0), t, heads, d, tables[0].data_ptr(), tables[0].stride(0),
                       tables[1].data_ptr(), tables[1].stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) · up`` of a fused ``[T, 2 · I]`` bfloat16 gate/up output (gate first, rows
    contiguous) → ``[T, I]`` contiguous, or None."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return None
    shape = _rows(gate_up, gate_up.shape[1])
    lib = _lib() if shape is not None else None
    if lib is None:
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty((shape[0], inter), dtype=torch.bfloat16)
    lib.llmd_silu_mul_bf16(gate_up.data_ptr(), shape[1], shape[0], inter, out.data_ptr(), torch.get_num_threads())
    return out
