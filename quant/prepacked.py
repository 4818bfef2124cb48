"""Dense bfloat16 linears on the CPU with their weights prepacked once for oneDNN.

``F.linear`` on bfloat16 CPU tensors calls oneDNN's matmul with the weight in its plain
``[out, in]`` layout (``ONEDNN_VERBOSE`` shows ``wei:bf16::blocked:ba``), so every call re-blocks
the weight panels it multiplies. Reordered once into oneDNN's own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, an opaque ``torch._mkldnn`` tensor of the same
bytes) the product runs through ``torch.ops.mkldnn._linear_pointwise``, the op torch inductor's
CPU backend emits for the same purpose (``torch/_inductor/fx_passes/mkldnn_fusion.py``); vLLM's
CPU backend prepacks its oneDNN matmuls likewise. The result is the same brgemm with the same
float32 accumulation: bit for bit equal to ``F.linear`` (``tests/quant/test_prepacked.py``
checks M = 1 … 600 and strided inputs).

Measured (2026-12-03, the 2-core Xeon with AMX-BF16, SmolLM2's 120 layer matmuls, bfloat16, ms
for all of them, median of 15, two runs): M = 8 30.7–30.8 → 24.4–24.7, M = 33 43.6–48.4 →
27.3–29.0, M = 64 59.8–64.0 → 35.1–39.0, M = 128 81.0–97.6 → 64.9–71.9, M = 300 224 → 158–185,
M = 512 283–287 → 206–294 (level). ``python benchmarks/prepacked_linear.py`` prints both side by
side.

Only bfloat16 weights of at most 2 dims on the CPU are packed (float32 goes through MKL's sgemm,
where prepacking measured no consistent gain); the module's ``weight`` Parameter then holds the
packed tensor (``is_mkldnn``; ``to_dense()`` gives the plain one back bit for bit), so the model
keeps one copy of its weights. ``LLMD_ONEDNN_PREPACK=0`` turns it off (the runner's A/B switch);
on a CPU where oneDNN cannot pack bfloat16 (AVX2 only: Zen 1–3) nothing is packed.

Where a tile-order kernel is installed (:mod:`llmd.kernels.amx_linear` on AMX CPUs, else
:mod:`llmd.kernels.dp_linear` on AVX512-BF16 CPUs; each registers :data:`tile_linear`: this layer
imports no kernels), weights whose sizes are multiples of 32 are
packed in its tile order instead (:func:`amx_pack`, a ``uint16 [out, in]`` tensor of the same
bytes; :func:`dense` unpacks it bit for bit) and :func:`linear` runs them through it; its numerics
and speed are in that module.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

BATCH_HINT = 64  # the packing's batch-size hint (the layout oneDNN picks; 64 and 512 measured alike)
# A tied LM head is packed as a copy of the embedding table only up to this size (its dense
# weight under --weight-quant, or a TiedHeadCopy without one). SmolLM2's
# (49,152 x 576 bfloat16, 54 MiB): batch-32 logits 9.5 -> 6.1 ms, batch 8 5.8 -> 2.4 ms (2-core Zen 4,
# 2026-12-05, bit-identical). Gemma 3 270M's (320 MiB) and Qwen3-0.6B's (297 MiB) stay shared.
HEAD_COPY_MAX_BYTES = 128 << 20


@functools.cache
def cpu_supported() -> bool:
    """Whether this torch's oneDNN can reorder a bfloat16 weight on this CPU (it needs AVX512-BW/VL/DQ
    or AVX-NE-CONVERT: on an AVX2-only CPU such as a Zen 3 ``_reorder_linear_weight`` raises
    RuntimeError "bf16 path needs the cpu support ..."). Probed once on a 16 × 16 weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), BATCH_HINT)
    except RuntimeError:
        return False
    return True


def enabled() -> bool:
    """False when ``LLMD_ONEDNN_PREPACK=0``, or oneDNN is not built into this torch or cannot pack
    bfloat16 weights on this CPU (:func:`cpu_supported`); bfloat16 linears then run ``F.linear``."""
    return os.environ.get("LLMD_ONEDNN_PREPACK", "1") != "0" and cpu_supported()


def packable(w: torch.Tensor) -> bool:
    """A plain 2-D bfloat16 CPU weight (the only kind :func:`prepack_model` converts)."""
    return w.dim() == 2 and w.dtype == torch.bfloat16 and w.device.type == "cpu" and not w.is_mkldnn


# The installed packed-weight kernel (llmd.kernels.amx_linear or llmd.kernels.dp_linear), registered
# by that module's install(): its product, its name for the startup line, and its pack / unpack
# (amx_pack / dp_pack and their inverses): this layer imports no kernels. None: packed for oneDNN only.
tile_linear = None
tile_kernel = ""
tile_pack = None
tile_unpack = None


def is_amx(w: torch.Tensor) -> bool:
    """``w`` is a pack of the installed kernel (:func:`amx_pack` or :func:`dp_pack`: its ``[out, in]``
    shape, uint16 elements in that kernel's order)."""
    return w.dtype == torch.uint16 and w.dim() == 2


def amx_packable(w: torch.Tensor) -> bool:
    """A plain bfloat16 ``[out, in]`` CPU weight whose sizes the tile-order kernels take (multiples of 32)."""
    return packable(w) and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0


def amx_pack(w: torch.Tensor) -> torch.Tensor:
    """bfloat16 ``W [N, K]`` in the AMX kernel's tile order (``kernels/native/amx_linear.c``:
    ``[N/32][K/32][2][16][16][2]``), returned as ``uint16 [N, K]``: the shape readers expect, and a
    dtype that no torch matmul takes by mistake. :func:`dense` undoes it bit for bit.
    (``dp_linear.c`` has its own order: :func:`dp_pack`.)"""
    n, k = w.shape
    t = w.contiguous().view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    return t.view(torch.uint16).view(n, k)


def amx_unpack(p: torch.Tensor) -> torch.Tensor:
    """The bfloat16 ``[N, K]`` weight of an :func:`amx_pack`, bit for bit."""
    n, k = p.shape
    t = p.view(torch.bfloat16).view(n // 32, k // 32, 2, 16, 16, 2).permute(0, 2, 4, 1, 3, 5)
    return t.contiguous().view(n, k)


DP_GROUP = 12  # dp_linear.c's output columns per group


def dp_pack(w: torch.Tensor) -> torch.Tensor:
    """bfloat16 ``W [N, K]`` (N, K multiples of 32) in the VDPBF16PS kernel's order
    (``kernels/native/dp_linear.c``): groups of 12 rows as ``[N / 12][K / 2][12]`` 32-bit pairs
    ``(W[n, 2p], W[n, 2p + 1])``, then the last ``N mod 12`` rows as ``[K / 2][N mod 12]``; returned
    as ``uint16 [N, K]`` as :func:`amx_pack`. :func:`dp_unpack` undoes it bit for bit."""
    n, k = w.shape
    full = n // DP_GROUP * DP_GROUP
    pairs = w.contiguous().view(torch.int32)  # [N, K / 2]
    head = pairs[:full].view(full // DP_GROUP, DP_GROUP, k // 2).permute(0, 2, 1).reshape(-1)
    return torch.cat([head, pairs[full:].t().reshape(-1)]).view(torch.uint16).view(n, k)


def dp_unpack(p: torch.Tensor) -> torch.Tensor:
    """The bfloat16 ``[N, K]`` weight of a :func:`dp_pack`, bit for bit."""
    n, k = p.shape
    full = n // DP_GROUP * DP_GROUP
    flat = p.contiguous().view(torch.int32).view(-1)
    head = flat[: full * k // 2].view(full // DP_GROUP, k // 2, DP_GROUP).permute(0, 2, 1).reshape(full, k // 2)
    tail = flat[full * k // 2:].view(k // 2, n - full).t()
    return torch.cat([head, tail]).contiguous().view(torch.bfloat16)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ w.T`` → ``[..., out]`` in x's dtype; ``w`` plain ``[out, in]``, prepacked
    for oneDNN, or an :func:`amx_pack` (then through :data:`tile_linear`)."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    if is_amx(w):
        if tile_linear is None:
            raise RuntimeError("prepacked.linear: a tile-packed weight, but no tile-order kernel is installed")
        return tile_linear(x, w)
    return F.linear(x, w)


def linear_params(model: nn.Module):
    """(module, parameter name) of every layer weight a forward passes to :func:`linear`: the
    decoder layers' ``Linear`` / ``MergedLinear`` weights (``nn.Linear`` subclasses with their own
    forward; a plain ``nn.Linear`` would hand a packed weight to ``F.linear``, so it is left out)
    and ``PackedLinear.dense``, and the LM head's dense weight under ``--weight-quant`` (the
    ``logits_proj`` PackedLinear that batches of more than ``small_batch`` rows multiply by) when
    :func:`_head_packable`. The embedding table itself stays plain (it is looked up by row)."""
    from llmd.quant.packed_linear import PackedLinear

    for layer in getattr(model, "layers", []):
        for mod in layer.modules():
            if isinstance(mod, nn.Linear) and type(mod).forward is not nn.Linear.forward:
                yield mod, "weight"
            elif isinstance(mod, PackedLinear) and mod.dense is not None:
                yield mod, "dense"
    head = getattr(model, "logits_proj", None)
    if isinstance(head, PackedLinear) and head.dense is not None and _head_packable(model, head.dense):
        yield head, "dense"


def _head_packable(model: nn.Module, dense: torch.Tensor) -> bool:
    """The LM head's dense weight is packed in place when it is its own tensor; when it is the
    embedding's table (a tied head), packing makes a second copy, so only while that copy stays
    under :data:`HEAD_COPY_MAX_BYTES`. A packed head stays packed (idempotence)."""
    return packed(dense) or not _is_embedding(model, dense) or dense.nbytes <= HEAD_COPY_MAX_BYTES


def _is_embedding(model: nn.Module, w: torch.Tensor) -> bool:
    """``w`` is the model's embedding table itself (a tied LM head's weight)."""
    emb = getattr(getattr(model, "embed_tokens", None), "weight", None)
    return emb is not None and not packed(w) and emb.data_ptr() == w.data_ptr()


def prepack_model(model: nn.Module, tiles: bool = True) -> int:
    """Replace every packable layer weight of ``model`` by its oneDNN-blocked copy, in place.

    ``tiles``: whether this model takes the installed tile-order kernel (:data:`tile_linear`)
    where the shape fits; False packs for oneDNN only. The install is process-wide and stays, so
    the model runner passes its own choice per model (``dp_linear.wanted``: a ``--weight-quant
    auto`` model keeps oneDNN even after another engine's ``none`` model installed VDPBF16PS).

    Idempotent (packed weights are skipped), so engines sharing one loaded model may each call
    it. Returns the number of weights packed now (0 when :func:`enabled` is false). Takes ~0.1 s
    for SmolLM2 (212 MB); the plain copy is freed (or, for a weights-cache mmap, unmapped).
    """
    if not enabled():
        return 0
    n = _pack_tied_head(model, tiles)
    for mod, name in linear_params(model):
        w = mod._parameters[name]
        if packable(w):
            if _is_embedding(model, w):  # a tied head: the table stays too
                mod.packed_copy_bytes = w.nbytes
            mod._parameters[name] = nn.Parameter(_pack(w.data, tiles), requires_grad=False)
            n += 1
    return n


def _pack(w: torch.Tensor, tiles: bool = True) -> torch.Tensor:
    """``w`` for the tile-order kernel when ``tiles``, one is installed and it takes the shape, else
    for oneDNN."""
    if tiles and tile_linear is not None and amx_packable(w):
        return tile_pack(w)
    return torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)


class TiedHeadCopy(nn.Module):
    """The LM head of a model whose head is its embedding table (tied) and that has no
    ``logits_proj`` of its own (``--weight-quant none``): a packed copy of the table (oneDNN's, or
    the tile-order kernel's where installed), made by :func:`prepack_model` under
    :data:`HEAD_COPY_MAX_BYTES` as for a ``--weight-quant`` head. ``forward(x [N, hidden] bfloat16)
    -> [N, vocab]``, bit for bit ``x @ table.T`` through oneDNN (the tile-order kernels' bounds:
    :mod:`llmd.kernels.amx_linear`, :mod:`llmd.kernels.dp_linear`). The copy is a
    plain attribute, not a parameter, so the model's state dict (and the weights' digest) is
    unchanged; :func:`unpack_model` removes it."""

    def __init__(self, packed: torch.Tensor, nbytes: int):
        super().__init__()
        self.dense = packed  # the name head_copy_bytes() reads, as on a PackedLinear
        self.packed_copy_bytes = nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.dense)


def _pack_tied_head(model: nn.Module, tiles: bool = True) -> int:
    """Give a tied model without a ``logits_proj`` a :class:`TiedHeadCopy` when its table is
    :func:`packable` and within :data:`HEAD_COPY_MAX_BYTES`; returns 1 if it did."""
    emb = getattr(getattr(model, "embed_tokens", None), "weight", None)
    if getattr(model, "logits_proj", 0) is not None or getattr(model, "lm_head", 0) is not None or emb is None:
        return 0
    if not packable(emb) or emb.nbytes > HEAD_COPY_MAX_BYTES:
        return 0
    model.logits_proj = TiedHeadCopy(_pack(emb.data, tiles), emb.nbytes)
    return 1


def head_copy_bytes(model: nn.Module) -> int:
    """Bytes of the packed copy :func:`prepack_model` made of a tied LM head's table while the head
    holds it (0: none, or :func:`unpack_model` has turned it plain since)."""
    head = getattr(model, "logits_proj", None)
    dense = getattr(head, "dense", None)
    return getattr(head, "packed_copy_bytes", 0) if dense is not None and packed(dense) else 0


def unpack_model(model: nn.Module) -> int:
    """Undo :func:`prepack_model` (plain ``[out, in]`` weights again, bit for bit); returns the
    number of weights converted. For benchmarks that compare both in one process, and for
    anything that needs plain weights of a model an engine packed."""
    n = 0
    if isinstance(getattr(model, "logits_proj", None), TiedHeadCopy):
        model.logits_proj, n = None, 1  # the table itself is the head again
    for mod, name in linear_params(model):
        w = mod._parameters[name]
        if packed(w):
            mod._parameters[name] = nn.Parameter(dense(w.data), requires_grad=False)
            n += 1
    return n


def packed_count(model: nn.Module) -> int:
    """How many of ``model``'s layer weights (and LM head) are prepacked now (the startup line names it)."""
    tied = isinstance(getattr(model, "logits_proj", None), TiedHeadCopy)
    return tied + sum(1 for mod, name in linear_params(model) if packed(mod._parameters[name]))


def packed(t: torch.Tensor) -> bool:
    """``t`` is a prepacked weight: oneDNN's (``is_mkldnn``) or an :func:`amx_pack`."""
    return t.is_mkldnn or is_amx(t)


def amx_count(model: nn.Module) -> int:
    """How many of :func:`packed_count`'s weights are tile-order packs (:func:`amx_pack`, run by
    :data:`tile_kernel`; the rest are oneDNN's)."""
    head = getattr(model, "logits_proj", None)
    tied = isinstance(head, TiedHeadCopy) and is_amx(head.dense)
    return tied + sum(1 for mod, name in linear_params(model) if is_amx(mod._parameters[name]))


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain strided tensor (``to_dense()`` of a oneDNN pack, the bfloat16 ``[out, in]``
    of an AMX pack, else ``t`` itself)."""
    if t.is_mkldnn:
        return t.to_dense()
    return tile_unpack(t) if is_amx(t) else t
