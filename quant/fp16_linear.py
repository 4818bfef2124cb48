"""Float32 linears on CPUs without native bfloat16: weights as float16 in fbgemm's packed layout.

Where ``--dtype auto`` runs a model in float32 (the CPU has neither AVX512-BF16 nor AMX: every
AVX2-only CPU, e.g. AMD Zen 1–3) the batched steps' matmuls went through MKL's float32 GEMM, which
is weak there at the row counts of decode steps. fbgemm's fp16 GEMM
(``torch.ops.quantized.linear_dynamic_fp16``: weights prepacked once by
``torch.ops.quantized.linear_prepack_fp16`` as float16, activations and accumulation float32, the
weights widened by F16C inside the kernel) reads half the bytes and runs the decode row counts
faster. Measured on the 2-core Zen 3 (2026-12-06, SmolLM2's 120 layer matmuls, ms for all of them,
``benchmarks/fp16_linear.py``): see the README section "Linears on AVX2-only CPUs".

Numerics: the product is ``x @ fp16(w).T`` in float32 (``tests/quant/test_fp16_linear.py``: within
1e-5 of that float64 product); the weights are rounded once to float16 (relative ≤ 2⁻¹¹, an
eighth of bfloat16's rounding). The packs are used only while :data:`active` (the model runner's
choice, per forward). The module keeps its float32 weight (the state dict, the
weights' digest and every reader of the weights are unchanged; the daemon's engine hands its pages
back to the kernel, :func:`release_dense_pages`); the pack lives beside it as the module attribute
:data:`ATTR`. Only the engine's ``--dtype auto`` float32 CPU models get packs
(:attr:`llmd.daemon.core.config.EngineConfig.fp16_weights`); an explicit ``--dtype float32`` keeps
MKL's float32 products, for exact float32 tokens. ``LLMD_FP16_WEIGHTS=0`` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from llmd.quant import prepacked

ATTR = "fp16_pack"  # the module attribute that holds a layer's fbgemm pack
# Whether the forward running now multiplies by the packs: set by the model runner around its
# forwards and logits (its engine's choice; engines sharing one loaded model may differ, as for
# :data:`llmd.kernels.cpu_glue.active`). Off: the float32 weights, as without packs.
active = False


@functools.cache
def available() -> bool:
    """Whether this torch has fbgemm's fp16 GEMM on this CPU (probed once on a 16 × 16 weight)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        pack = torch.ops.quantized.linear_prepack_fp16(torch.ones(16, 16), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 16), pack)
    except (RuntimeError, AttributeError):
        return False
    return True


def enabled() -> bool:
    """:func:`available` and ``LLMD_FP16_WEIGHTS`` is not ``0``."""
    return os.environ.get("LLMD_FP16_WEIGHTS", "1") != "0" and available()


def pack(w: torch.Tensor):
    """fbgemm's fp16 pack of a float32 ``[out, in]`` weight (a torchbind object)."""
    return torch.ops.quantized.linear_prepack_fp16(w.contiguous(), None)


def linear(x: torch.Tensor, packed) -> torch.Tensor:
    """``x [..., in]`` float32 → ``[..., out]`` float32: ``x @ fp16(w).T``."""
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


class Fp16Head(nn.Module):
    """The LM head of a model without a ``logits_proj``: an fp16 pack of its weight (the tied
    embedding table or its own ``lm_head``, which stay). ``forward(x [N, hidden]) -> [N, vocab]``:
    by the pack for float32 ``x`` while :data:`active`, else ``x @ weight.T`` as the model's own
    head. Neither is a parameter: the state dict is unchanged."""

    def __init__(self, weight: torch.Tensor, packed, nbytes: int):
        super().__init__()
        self.__dict__["weight_ref"] = weight
        self.__dict__[ATTR] = packed
        self.pack_bytes = nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if active and x.dtype == torch.float32:
            return linear(x, self.__dict__[ATTR])
        return x @ self.__dict__["weight_ref"].t()


def _packable(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu" and not w.is_mkldnn


def pack_model(model: nn.Module) -> int:
    """Give every float32 layer weight a forward multiplies by (the layers' ``Linear`` /
    ``MergedLinear`` weights, ``PackedLinear.dense``, the LM head: :func:`prepacked.linear_params`)
    an fp16 pack, once (idempotent: engines sharing a loaded model find them packed). Returns the
    number packed now (0 when :func:`enabled` is false)."""
    if not enabled():
        return 0
    n = 0
    emb = getattr(getattr(model, "embed_tokens", None), "weight", None)
    if getattr(model, "logits_proj", 0) is None and emb is not None:
        w = emb if getattr(model, "lm_head", None) is None else model.lm_head
        if _packable(w):
            model.logits_proj, n = Fp16Head(w, pack(w.data), w.numel() * 2), 1
    for mod, name in prepacked.linear_params(model):
        w = mod._parameters[name]
        if ATTR not in mod.__dict__ and _packable(w):
            mod.__dict__[ATTR] = pack(w.data)
            mod.__dict__["fp16_pack_bytes"] = w.numel() * 2
            n += 1
    return n


MADV_PAGEOUT = 21  # linux/mman.h (Linux 5.4+)


def _pageout(t: torch.Tensor) -> int:
    """``madvise(MADV_PAGEOUT)`` over the whole pages inside ``t``'s bytes; returns the bytes
    advised (0 where the call fails: an older kernel, not Linux)."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr()
    lo, hi = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
    if hi <= lo:
        return 0
    libc = _libc()
    ok = libc is not None and libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_PAGEOUT) == 0
    return hi - lo if ok else 0


@functools.cache
def _libc():
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def release_dense_pages(model: nn.Module) -> int:
    """Hand the float32 weights the packs replaced back to the kernel: ``madvise(MADV_PAGEOUT)``
    over each packed weight (and the packed LM head's table). Call it only on a model no engine
    without packs will run (the daemon's own; :meth:`Engine.from_config` does).

    Safe for any memory: under the weights cache the weights are a private file mapping whose
    clean pages are dropped and, if a later forward reads them after all, fault back in from the
    file with the same bytes; anonymous memory (a cold start, no cache) is swapped out where there
    is swap and otherwise left as it is. Measured on SmolLM2 (2026-12-06, Zen 3): the process's RSS
    after start-up 1,270 → 756 MiB, after a batch and a batch-1 request 1,309 → 876 MiB.

    Returns:
        bytes advised (whole pages inside the weights; what the kernel actually frees is the
        part it can reclaim).
    """
    seen, n = set(), 0
    weights = [m.__dict__["weight_ref"] for m in model.modules() if isinstance(m, Fp16Head)]
    weights += [mod._parameters[name] for mod, name in prepacked.linear_params(model) if ATTR in mod.__dict__]
    for w in weights:
        if w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            n += _pageout(w.data)
    return n


def unpack_model(model: nn.Module) -> int:
    """Undo :func:`pack_model` (the float32 weights were kept); returns the number of packs dropped."""
    n = 0
    if isinstance(getattr(model, "logits_proj", None), Fp16Head):
        model.logits_proj, n = None, 1
    for mod in model.modules():
        if mod.__dict__.pop(ATTR, None) is not None:
            mod.__dict__.pop("fp16_pack_bytes", None)
            n += 1
    return n


def packed_count(model: nn.Module) -> tuple[int, int]:
    """``(packs, bytes)`` of fp16 packs in ``model`` now (the startup line names them)."""
    mods = [m for m in model.modules() if ATTR in m.__dict__]
    return len(mods), sum(m.__dict__.get("fp16_pack_bytes", 0) + getattr(m, "pack_bytes", 0) for m in mods)
