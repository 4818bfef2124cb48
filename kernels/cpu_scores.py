"""Float32 attention scores of bfloat16 queries and keys on the CPU, by VDPBF16PS, alone
(:func:`scores`) or followed in the same call by the softmax (:func:`probs`: bfloat16
probabilities out, the float32 scores never a tensor); ``kernels/native/bf16_scores.c`` documents
the packing and the numerics.

The cpu backend's prefill chunks, cascade prefixes and chunk tails of a bfloat16 model score
``q · K`` in float32 (see :mod:`llmd.kernels.cpu_attention`). torch's CPU ``bmm`` of two bfloat16
tensors returns bfloat16, so without this kernel K is converted to float32 and a float32
``baddbmm`` runs. With it, K stays bfloat16 and the products are the same exact products, summed
in float32.

Used where :func:`available` holds: the library built (:func:`llmd.kernels.native.build.load_scores`:
a compiler, AVX512-BF16 under ``-march=native``), ``LLMD_BF16_SCORES`` not ``0`` and
:func:`set_enabled` not turned off (the benchmark's A/B).
"""

from __future__ import annotations

import os

import torch

from llmd.kernels.native import build

_enabled = os.environ.get("LLMD_BF16_SCORES", "1") != "0"


def available() -> bool:
    """The kernel is built for this CPU and switched on."""
    return _enabled and build.load_scores() is not None


def set_enabled(on: bool) -> bool:
    """Switch the kernel on or off in this process (for side-by-side runs); returns :func:`available`."""
    global _enabled
    _enabled = bool(on)
    return available()


def _rows_ok(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and t.dtype == dtype and t.dim() == 3 and t.stride(-1) == 1


def _fits(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, out_dtype: torch.dtype,
          bias_batch_div: int) -> bool:
    """The kernel is available and takes these layouts (see :func:`scores`)."""
    b, m, d = q.shape
    n = k.shape[1]
    if not (available() and _rows_ok(q, torch.bfloat16) and _rows_ok(k, torch.bfloat16) and _rows_ok(out, out_dtype)
            and k.shape[0] == b and k.shape[2] == d and tuple(out.shape) == (b, m, n) and d % 2 == 0 and d <= 256):
        return False
    return bias is None or (_rows_ok(bias, torch.float32) and bias.shape[2] == n and bias.shape[1] >= 1
                            and m % bias.shape[1] == 0 and bias_batch_div >= 1 and bias.shape[0] * bias_batch_div == b)


def _operands(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, bias_batch_div: int) -> tuple:
    """The C functions' leading arguments: q, k and the mask with their strides."""
    mask = (bias.data_ptr(), bias.stride(0), bias.stride(1), bias_batch_div, bias.shape[1]) if bias is not None \
        else (None, 0, 0, bias_batch_div, 1)
    return (q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), *mask)


def scores(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None, out: torch.Tensor,
           bias_batch_div: int = 1) -> bool:
    """``out = scale · q kᵀ + bias`` per batch entry, or False (``out`` untouched) when the kernel
    is unavailable or a layout does not fit.

    Args:
        q: ``[B, M, D]`` bfloat16, channels contiguous; ``k``: ``[B, N, D]`` bfloat16, channels
            contiguous; D even, at most 256.
        scale: float32 factor applied to the sums (before the bias).
        bias: None, or float32 ``[B / bias_batch_div, R, N]`` with keys contiguous and R dividing
            M: entry ``b``'s row ``m`` adds ``bias[b // bias_batch_div, m % R]`` (the cpu backend's
            ``[N, 1, Q, L]`` mask viewed ``[N, Q, L]`` serves its ``N · kv_heads`` entries of
            ``group · Q`` rows with ``bias_batch_div = kv_heads``, unexpanded).
        out: ``[B, M, N]`` float32, keys contiguous.
    Returns:
        True when ``out`` holds the scores.
    Raises:
        RuntimeError: the packing buffer could not be allocated.
    """
    if not _fits(q, k, bias, out, torch.float32, bias_batch_div):
        return False
    rc = build.load_scores().llmd_bf16_scores(
        *_operands(q, k, bias, bias_batch_div), out.data_ptr(), out.stride(0), out.stride(1),
        *q.shape[:2], k.shape[1], q.shape[2], scale, torch.get_num_threads())
    if rc == -2:
        raise RuntimeError("cpu_scores: could not allocate the packed keys")
    return rc == 0


def probs(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None, out: torch.Tensor,
          bias_batch_div: int = 1, lse: torch.Tensor | None = None) -> bool:
    """``out = softmax(scale · q kᵀ + bias)`` as bfloat16, the float32 scores kept in a per-thread
    scratch of a few rows (never a ``[B, M, N]`` tensor), or False (nothing written) when the
    kernel is unavailable or a layout does not fit.

    Args:
        q, k, scale, bias, bias_batch_div: as :func:`scores`.
        out: ``[B, M, N]`` bfloat16, keys contiguous: the probabilities, torch's float32 softmax
            (max, ``exp(s - max)``, sum, ``× 1/sum``; the exponential within 1-2 float32 ulp of
            torch's) rounded to nearest even bfloat16; a row of only -inf scores gives zeros.
        lse: None, or ``[B, M]`` float32 contiguous: each row's log-sum-exp (``max + log(sum)``,
            -inf for a row of only -inf).
    Returns:
        True when ``out`` (and ``lse``) hold the result.
    Raises:
        RuntimeError: a workspace could not be allocated.
    """
    if not _fits(q, k, bias, out, torch.bfloat16, bias_batch_div):
        return False
    if lse is not None and not (lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:2])
                                and lse.stride(1) == 1):
        return False
    rc = build.load_scores().llmd_bf16_attn_probs(
        *_operands(q, k, bias, bias_batch_div), out.data_ptr(), out.stride(0), out.stride(1),
        lse.data_ptr() if lse is not None else None, lse.stride(0) if lse is not None else 0,
        *q.shape[:2], k.shape[1], q.shape[2], scale, torch.get_num_threads())
    if rc == -2:
        raise RuntimeError("cpu_scores: could not allocate the packed keys or a row scratch")
    return rc == 0
