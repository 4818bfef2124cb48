"""``--weight-quant``: replace a loaded model's linear layers by weight-only packs.

Modes (CPU; the packs are torch's CPU kernels, see :mod:`llmd.quant.packed_linear`):

* ``gguf``: keep the file's own quantization where a kernel matches it exactly: Q4_0 / Q4_1 /
  Q4_K → int4 groups of 32 (codes and the file's scales, rounded to the compute dtype);
  Q8_0 → int8 per output row (re-quantized: torch has no grouped int8 kernel). A fused
  projection is packed only when all its parts are of one family; anything else (Q5_0, Q6_K,
  F16, mixed parts) stays dense and is listed in the summary.
* ``int8``: every linear re-quantized to symmetric int8 with one scale per 32 input columns
  (Q8_0's grid) from its float32 dequantization (on a CPU :mod:`llmd.quant.int8_groups`: the
  nibble-split int4 kernel for bfloat16 steps of a few rows, dequantize + matmul otherwise; a
  weight with K % 32 != 0 per-row int8 for ``_weight_int8pack_mm``); on CUDA bitsandbytes'
  LLM.int8(), :class:`~llmd.quant.bnb_linear.BnbLinear`.
* ``nf4`` / ``fp4``: every linear re-quantized by bitsandbytes to 4-bit NF4 / FP4 blocks of 64
  with a float32 absmax each (:mod:`llmd.quant.bnb_linear`; on an AVX512-BF16 CPU in bitsandbytes'
  CPU layout with bfloat16 absmax), on CPU and CUDA. The GGUF's 4-bit weights are quantized a
  second time, so the error compounds (README "Weights": the measured ΔNLL).

The lm_head (tied to the embedding in SmolLM2 and Gemma 3) is packed too: int4 when its tensor
is a 4-bit type, else per-row int8 (``int8``, ``nf4`` / ``fp4``: in that format); the embedding lookup keeps
the dense table. With
``keep_dense`` every packed layer also keeps its dense weight for batches of more than
``SMALL_BATCH`` rows (see the measurements there), costing the packs' bytes on top of the
dense model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from llmd.models.errors import GGUFLoadError
from llmd.models.weight_bytes import weight_bytes  # noqa: F401  (re-exported: its home before)
from llmd.quant import bnb_linear, int8_groups, native_packs
from llmd.quant.bnb_linear import BnbLinear
from llmd.quant.gguf_packs import GROUP, INT4_TYPES, INT8_TYPES, int4_codes, int8_rows
from llmd.quant.packed_linear import SMALL_BATCH, PackedLinear, pack_int4, pack_int8

WEIGHT_QUANT_MODES = ("none", "gguf", "int8", "nf4", "fp4")
BNB_4BIT_MODES = ("nf4", "fp4")  # through bitsandbytes on every device


@dataclass
class WeightQuantSummary:
    """What :func:`quantize_linears` did: layer counts per kind, the dense ones by name, bytes.

    ``bnb``: layers run by bitsandbytes (``nf4`` / ``fp4``, CUDA ``int8``), ``layouts`` their
    layouts ("cpu" / "plain", :mod:`llmd.quant.bnb_linear`)."""

    mode: str
    int4: int = 0
    int8: int = 0
    dense: list[str] = field(default_factory=list)
    pack_bytes: int = 0
    dense_bytes: int = 0
    bnb: int = 0
    layouts: list[str] = field(default_factory=list)
    native_bytes: int = 0  # the fused decode kernel's copy of the packs (quant/native_packs.py)
    small_batch: int | None = None  # packs beside kept dense weights: steps of <= this many rows take the packs

    def describe(self) -> str:
        """One line for the startup message, e.g. ``weights gguf: 210 int4 + 1 int8 layers, 71 MiB``,
        ``weights nf4 (bitsandbytes, cpu layout): 211 nf4 layers, 72 MiB + 54 MiB dense``, or under
        ``--weight-quant auto`` (dense weights kept) ``weights gguf: 120 int4 + 1 int8 layers, 90 MiB
        for steps of <= 4 tokens + 257 MiB dense for larger steps + 92 MiB fused-decode copy
        (batch-1 steps)``."""
        if self.mode == "none":
            return f"weights dense ({self.dense_bytes / 2**20:.0f} MiB)"
        if self.bnb:
            kind = "int8" if self.mode == "int8" else self.mode
            text = (f"weights {self.mode} (bitsandbytes, {'+'.join(self.layouts)} layout): {self.bnb} {kind} layers, "
                    f"{self.pack_bytes / 2**20:.0f} MiB")
        elif self.mode == "int8":
            text = f"weights int8 (groups of 32): {self.int8} int8 layers, {self.pack_bytes / 2**20:.0f} MiB"
        else:
            text = f"weights {self.mode}: {self.int4} int4 + {self.int8} int8 layers, {self.pack_bytes / 2**20:.0f} MiB"
        if self.small_batch:  # --weight-quant auto: the packs serve small steps, the dense weights the rest
            text += f" for steps of <= {self.small_batch} tokens"
        if self.dense_bytes:
            text += f" + {self.dense_bytes / 2**20:.0f} MiB dense"
            if self.small_batch == 0:  # a float32 model: the packs serve only the fused kernel
                text += " for steps the fused kernel does not take"
            elif self.small_batch:
                text += " for larger steps"
        if self.native_bytes:
            text += f" + {self.native_bytes / 2**20:.0f} MiB fused-decode copy (batch-1 steps)"
        if self.dense:
            text += f"; dense (no exact kernel): {', '.join(self.dense[:3])}"
            text += f" and {len(self.dense) - 3} more" if len(self.dense) > 3 else ""
        return text


def _dequantized(model, name: str, t) -> np.ndarray:
    from llmd.models.gguf_loader import dequantize_tensor

    return model.transform_gguf_tensor(name, dequantize_tensor(t))


def _int4_parts(model, parts, k: int):
    """Codes/scales/zeros of the parts, each through the model's row transform, stacked by rows."""
    codes, scales, zeros = [], [], []
    for name, t, n in parts:
        c, s, z = int4_codes(t.data, t.tensor_type, n, k)
        # the transforms are row permutations (llama Q/K): apply the same one to each array
        codes.append(model.transform_gguf_tensor(name, c.astype(np.float32)))
        scales.append(model.transform_gguf_tensor(name, s))
        zeros.append(model.transform_gguf_tensor(name, z))
    return (torch.from_numpy(np.concatenate(codes)), torch.from_numpy(np.concatenate(scales)),
            torch.from_numpy(np.concatenate(zeros)))


def _q8_parts(model, parts, k: int):
    """The fused kernel's Q8 pack of Q8_0 parts, each through the model's row transform, stacked."""
    codes, scales = [], []
    for name, t, n in parts:  # the row transforms (llama Q/K) on row-major blocks, then the tile layout
        c, s = native_packs.q8_blocks(t.data, t.tensor_type, n, k)
        codes.append(model.transform_gguf_tensor(name, c))
        scales.append(model.transform_gguf_tensor(name, s))
    return native_packs.Q8, native_packs.q8_pack(np.concatenate(codes), np.concatenate(scales))


def _pack(model, parts, k: int, mode: str, dtype: torch.dtype, native: bool = False):
    """``("int4" | "int8" | "int8g", packs, native)`` for the GGUF tensors ``parts`` of one layer, or
    None (dense). ``mode`` "int8rows": per-row int8 (the ``gguf`` head's fallback). ``native``:
    also the fused decode kernel's pack (:mod:`llmd.quant.native_packs`) of the file's own
    blocks, when K allows it (``(kind, pack)``, else None)."""
    types = {t.tensor_type for _, t, _ in parts}
    rows = sum(n for _, _, n in parts)
    if mode == "gguf" and types <= INT4_TYPES and k % GROUP == 0 and rows % 16 == 0:  # the pack needs N % 16
        codes, scale, zero = _int4_parts(model, parts, k)
        fused = None
        if native and k % 32 == 0:
            fused = native_packs.Q4, native_packs.q4_pack(codes.numpy(), scale.numpy(), zero.numpy())
        return "int4", pack_int4(codes, scale, zero, dtype), fused
    if mode == "int8" and k % GROUP == 0:
        w = np.concatenate([_dequantized(model, name, t) for name, t, _ in parts])
        codes, scale = int8_groups.quantize(w, dtype)
        return "int8g", int8_groups.pack(codes, scale, dtype), None
    if mode in ("int8", "int8rows") or (mode == "gguf" and types <= INT8_TYPES):
        codes, scale = int8_rows(np.concatenate([_dequantized(model, name, t) for name, t, _ in parts]))
        fused = _q8_parts(model, parts, k) if native and types <= INT8_TYPES and rows % 16 == 0 else None
        return "int8", pack_int8(torch.from_numpy(codes), torch.from_numpy(scale), dtype), fused
    return None


def _bnb_layer(model, parts, k: int, mode: str, dtype: torch.dtype, device: str, sizes=None):
    """A :class:`BnbLinear` of ``mode`` ("nf4" / "fp4", or "int8" for CUDA) from the float32
    dequantization of the GGUF tensors ``parts`` (stacked by rows)."""
    w = np.concatenate([_dequantized(model, name, t) for name, t, _ in parts])
    if mode == "int8":
        return BnbLinear(k, w.shape[0], "int8", *bnb_linear.quantize_int8(w), sizes=sizes)
    layout = bnb_linear.layout_for(w.shape[0], k, dtype, device)
    packed, scales = bnb_linear.quantize_4bit(torch.from_numpy(w), mode, layout)
    return BnbLinear(k, w.shape[0], mode, packed, scales, layout, sizes)


def uses_bnb(mode: str, device: str) -> bool:
    """Whether ``mode`` on ``device`` ("cpu" / "cuda...") goes through bitsandbytes."""
    return mode in BNB_4BIT_MODES or (mode == "int8" and not device.startswith("cpu"))


def quantize_linears(model: nn.Module, tensors: dict, mode: str, *, keep_dense: bool = False,
                     device: str = "cpu", native: bool = False) -> WeightQuantSummary:
    """Swap the linear layers (and the lm_head) of a loaded GGUF model for :class:`PackedLinear`
    (torch's CPU kernels) or :class:`~llmd.quant.bnb_linear.BnbLinear` (bitsandbytes).

    Args:
        model: a model :func:`~llmd.models.gguf_loader.load_model` filled (on the CPU).
        tensors: GGUF tensor name → ``GGUFReader`` tensor, for the file it was loaded from.
        mode: one of :data:`WEIGHT_QUANT_MODES`.
        keep_dense: keep each packed layer's dense weight for larger batches (torch packs only).
        native: give each torch-packed layer (and the head) a second copy of the file's blocks in
            the fused single-stream decode kernel's layout (:mod:`llmd.quant.native_packs`;
            ``gguf`` Q4_0/Q4_1/Q4_K and Q8_0 tensors with K a multiple of 64).
        device: where the model will run ("cpu" / "cuda..."): picks bitsandbytes for ``int8`` off
            the CPU and the 4-bit layout (:func:`~llmd.quant.bnb_linear.layout_for`).
    Returns:
        A :class:`WeightQuantSummary`. The model computes in its parameters' dtype throughout.
    Raises:
        GGUFLoadError: unknown mode, or bitsandbytes needed and not importable.
    """
    if mode not in WEIGHT_QUANT_MODES:
        raise GGUFLoadError(f"--weight-quant must be one of {', '.join(WEIGHT_QUANT_MODES)}, got {mode!r}")
    summary = WeightQuantSummary(mode)
    if mode == "none":
        summary.dense_bytes = sum(p.nbytes for p in model.parameters())
        return summary
    bnb = uses_bnb(mode, str(device))
    if bnb:
        from llmd.quant.bnb import import_bitsandbytes

        try:
            import_bitsandbytes()
        except ImportError as e:
            raise GGUFLoadError(f"--weight-quant {mode}: {e}") from None
    by_param: dict[str, list] = {}
    for name, slot in model.gguf_tensor_map().items():
        rows = slot.rows or (0, None)
        by_param.setdefault(slot.param, []).append((rows[0], name))
    dtype = model.embed_tokens.weight.dtype  # the kernels take scales in the activation dtype
    # torch's int4 kernel runs ~30x slower on float32 activations (README "Weights"): a float32 model
    # that keeps its dense weights uses them for every step the fused kernel does not take
    small_batch = 0 if keep_dense and dtype == torch.float32 else SMALL_BATCH
    summary.small_batch = small_batch if keep_dense and not bnb else None
    targets = [(mod_name, mod) for mod_name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for mod_name, mod in targets:
        names = [n for _, n in sorted(by_param.get(f"{mod_name}.weight", []))]
        sizes = getattr(mod, "sizes", None) or [mod.out_features]
        parts = [(n, tensors[n], rows) for n, rows in zip(names, sizes)]  # rows of each part, in row order
        if bnb and parts:
            model.set_submodule(mod_name, _bnb_layer(model, parts, mod.in_features, mode, dtype, str(device),
                                                     getattr(mod, "sizes", None)))
            summary.bnb += 1
            continue
        packed = _pack(model, parts, mod.in_features, mode, dtype, native) if parts else None
        if packed is None:
            summary.dense.append(mod_name)
            continue
        kind, packs, fused = packed
        new = PackedLinear(mod.in_features, mod.out_features, **{kind: packs},
                           dense=mod.weight.data if keep_dense else None, sizes=getattr(mod, "sizes", None),
                           native=fused, small_batch=small_batch)
        model.set_submodule(mod_name, new)
        summary.int4 += kind == "int4"
        summary.int8 += kind != "int4"
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head
    tied = model.lm_head is None  # a tied head's dense table stays anyway (the lookup): batches use it
    head_parts = [(head, tensors[head], w.shape[0])]
    if bnb:  # the head in the same format: no dense path for batches, so every logit is the format's
        model.logits_proj = _bnb_layer(model, head_parts, w.shape[1], mode, dtype, str(device))
        summary.bnb += 1
    else:
        kind, packs, fused = _pack(model, head_parts, w.shape[1], mode, dtype, native) or \
            _pack(model, head_parts, w.shape[1], "int8rows", dtype, native)
        model.logits_proj = PackedLinear(w.shape[1], w.shape[0], **{kind: packs},
                                         dense=w.data if keep_dense or tied else None, native=fused,
                                         small_batch=small_batch)
        summary.int4 += kind == "int4"
        summary.int8 += kind != "int4"
    if not tied:
        model.lm_head = None  # the packs (and the dense copy, if kept) replace it
    for mod in model.modules():
        if isinstance(mod, (PackedLinear, BnbLinear)):
            pb, db = mod.nbytes()
            summary.pack_bytes += pb
            summary.native_bytes += mod.native_nbytes() if isinstance(mod, PackedLinear) else 0
            summary.dense_bytes += db if mod is not model.logits_proj or not tied else 0
            if isinstance(mod, BnbLinear) and mod.layout not in summary.layouts:
                summary.layouts.append(mod.layout)
    summary.dense_bytes += sum(p.nbytes for n, p in model.named_parameters() if "dense" not in n.split("."))
    return summary
