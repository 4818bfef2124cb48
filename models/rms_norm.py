"""The RMSNorms of the model files: :class:`RMSNorm` (HF ``LlamaRMSNorm``: normalised in float32,
weight applied in x's dtype; a one-kernel weight-norm form for decode steps of few 16-bit tokens,
and the C layer glue's one pass when the runner turns it on) and :class:`GemmaRMSNorm` (HF
``Gemma3RMSNorm``: the weight applied in float32 too).

Both take ``x [..., dim]`` and return ``[..., dim]`` in x's dtype; ``weight`` is ``[dim]`` in the
model dtype. Numerics and measurements are in the class docstrings. Every name is re-exported by
:mod:`llmd.models.layers` (their home before), whose :class:`~llmd.models.layers.PagedAttention`
takes either as its per-head Q/K norm.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from llmd.kernels import cpu_glue


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``w * (x / sqrt(mean(x²) + eps)).to(x.dtype)``, normalised
    in float32, weight applied in x's dtype (HF ``LlamaRMSNorm``).

    ``forward(x [..., dim]) -> [..., dim]`` in x's dtype (float64 inputs normalise in float32,
    as the original ``x.float()`` code did). ``weight``: ``[dim]`` in the model dtype.

    ``F.rms_norm`` equals the explicit ``x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)``
    form bit for bit (on CPU, torch 2.13's ``_fused_rms_norm`` runs the same float32 ops, pow,
    mean, add, rsqrt, mul, in C++: one Python-level call instead of five), checked in float32 /
    bfloat16 / float16 on shapes [1|32|257, 576], [64, 640], [32, 4, 256], [300, 9, 64] and
    strided views, eps 1e-5 and 1e-6, input scales 1e-3..30. The weight inside it (``F.rms_norm(x,
    w)``) is exact only in float32 (16-bit would round once instead of twice), so 16-bit inputs
    use ``w * F.rms_norm(x)``; float64 is normalised in float32 as before (``F.rms_norm`` on
    float64 would reduce in float64). Measured (old explicit form → now, hidden 576, best of
    3 × 7 × 400 calls interleaved, 2-core AVX-512 CPU shared with other work, load ~6):
    float32 T=1 15.3 → 12.1 µs, T=32 20.6 → 17.7 µs; bfloat16 T=1 17.4 → 14.6 µs,
    T=32 27.5 → 24.9 µs.

    **Steps of at most** ``FUSED_NORM_MAX_TOKENS`` **tokens of 16-bit inputs whose** ``dim`` **is a
    square** (``sqrt(dim)`` exact in the dtype: SmolLM2's 576 = 24², Qwen3's 1024, Llama 3's 4096;
    the decode steps of a few streams, where ``--weight-quant auto`` runs the int4 packs too) take
    one fused kernel instead of ``F.rms_norm``'s nine
    (``_fused_rms_norm`` is composite on CPU: to, pow, sum, div, add, rsqrt, mul, to): weight
    normalization (Salimans & Kingma 2016; ``torch._weight_norm``, ``g · v / ‖v‖`` per row, float
    accumulation) of ``v = [x, c₁, c₂, c₃]`` with ``Σ cᵢ² = dim · eps`` and ``g = sqrt(dim)`` is
    ``x · sqrt(dim) / sqrt(Σx² + dim · eps) = x / sqrt(mean(x²) + eps)``, so the norm is one
    ``cat``, that kernel and the weight's ``mul``. The float32 factor can differ from
    ``rsqrt(mean + eps)`` in its last bit (another summation order and op sequence; the three
    16-bit pad values carry eps to ~1e-7); after the rounding to 16 bits the outputs equal
    ``F.rms_norm``'s on all but ~1e-5 of elements, which differ by one ulp
    (``tests/models/test_rms_norm_fused.py``). Both forms are equally close to the exact value
    (bfloat16, 8,192 × 576 normal rows: 99.9991 % vs 99.9994 % correctly rounded, mean signed error
    -4.3e-7 in both). In the model (a batch-1 decode step, bfloat16, one thread) a norm took ~30
    µs before, 61 per step. Larger steps (prefill chunks, big decode batches) keep ``F.rms_norm``:
    nine kernels cost little there, and their numerics, and the teacher-forced quality figures
    measured through them, stay as they were.

    **When the runner turns on the C layer glue** (bfloat16 on the ``cpu`` backend:
    :data:`llmd.kernels.cpu_glue.active`), every 16-bit step of rows with a contiguous last dim
    takes :func:`llmd.kernels.cpu_glue.rms_norm` instead: one pass, x² summed in double, the same
    two bfloat16 roundings (7 of 1.2 M outputs differ from ``F.rms_norm``'s, by ≤ 2 ulps).
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.shape = (dim,)
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        root = math.isqrt(dim)  # sqrt(dim) exact in bfloat16 (8 significant bits) / float16 (11)
        self._fused_dtypes = {dt for dt, bits in ((torch.bfloat16, 8), (torch.float16, 11))
                              if root * root == dim and root >> max(0, root.bit_length() - bits)
                              << max(0, root.bit_length() - bits) == root}
        self._columns: dict = {}  # (rows, dtype, device) -> (pad [rows, PAD_TERMS], g [rows, 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._parameters["weight"]
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, w, self.eps)
        if x.dtype == torch.float64:
            return w * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)
        if cpu_glue.active and (y := cpu_glue.rms_norm(x, w, self.eps)) is not None:
            return y  # one C pass (kernels/cpu_glue.py): within 2 bfloat16 ulps, on ~6e-6 of elements
        if x.shape[0] <= FUSED_NORM_MAX_TOKENS and x.dtype in self._fused_dtypes:
            dim = self.shape[0]
            rows = x if x.dim() == 2 else x.reshape(-1, dim)
            c, g = self._pad_columns(rows.shape[0], x.dtype, x.device)
            y = w * torch._weight_norm(torch.cat((rows, c), 1), g, 0)[:, :dim]
            return y if x.dim() == 2 else y.view(x.shape)
        return w * F.rms_norm(x, self.shape, eps=self.eps)

    def _pad_columns(self, rows: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pad ``[rows, PAD_TERMS]`` (:func:`_eps_terms` of ``dim · eps``) and ``g = sqrt(dim)``
        as ``[rows, 1]`` (the kernel wants a contiguous ``g``), kept for the few row counts a run
        sees (decode steps, chunk sizes)."""
        key = (rows, dtype, device)
        cols = self._columns.get(key)
        if cols is None:
            if len(self._columns) >= 16:
                self._columns.clear()
            dim = self.shape[0]
            pad = _eps_terms(dim * self.eps, dtype).to(device).expand(rows, PAD_TERMS).contiguous()
            cols = self._columns[key] = (pad, torch.full((rows, 1), math.sqrt(dim), dtype=dtype, device=device))
        return cols


PAD_TERMS = 3  # 16-bit values whose squares sum to dim · eps (to ~1e-7 relative in bfloat16)
FUSED_NORM_MAX_TOKENS = 4  # RMSNorm's one-kernel form for steps of at most this many tokens


def _eps_terms(total: float, dtype: torch.dtype) -> torch.Tensor:
    """``[PAD_TERMS]`` values in ``dtype`` whose squares (summed in float32 by the kernel) give
    ``total``: each the largest value whose square fits in what the previous ones left."""
    terms, rest = [], total
    for _ in range(PAD_TERMS):
        c = torch.tensor(math.sqrt(rest), dtype=dtype)
        if float(c) ** 2 > rest:  # rounded up: take the neighbour below, so the rest stays >= 0
            c = torch.nextafter(c, torch.zeros((), dtype=dtype))
        terms.append(c)
        rest -= float(c) ** 2
    return torch.stack(terms)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``(x / sqrt(mean(x²) + eps)) * w`` entirely in float32, then cast.

    HF (``Gemma3RMSNorm``) multiplies by ``1 + w_hf`` in float32; GGUF files store
    ``w = 1 + w_hf`` already (llama.cpp's converter adds the 1), so ``w`` is used as stored.
    ``forward(x [..., dim]) -> [..., dim]`` in x's dtype. ``F.rms_norm(x, w)`` computes exactly
    this for float32 and 16-bit inputs (bit for bit, same checks as :class:`RMSNorm`; float64
    normalised in float32 as before). Measured as for :class:`RMSNorm`: float32 T=1 15.9 → 12.0
    µs, T=32 21.1 → 17.9 µs; bfloat16 T=1 18.7 → 14.9 µs, T=32 27.1 → 24.0 µs.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._parameters["weight"]
        if x.dtype == torch.float64:
            return F.rms_norm(x.float(), self.shape, w.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, self.shape, w, self.eps)
