"""KV cache quality (cases Q1 and Q4): teacher-forced NLL and top-1 agreement per ``--kv-cache-dtype``.

A fixed ~1,000-token text is fed in chunks of 64 tokens through the engine's own runner and
paged cache (:meth:`Engine.teacher_forced_logits`): each chunk stores its K/V (quantized) first
and attends to what it reads back (store-then-read), so the quantized cache is what is measured.
For every KV dtype we report mean NLL of the next token, ΔNLL relative to the model-dtype cache,
and top-1 agreement with the model-dtype run. :func:`hf_fake_quant_nll` is the independent reference: HF transformers
with K/V fake-quantized inside attention by :func:`fake_quant_reference`, written from the spec
with torch's own casts (not llmd's quantizer); for int4 (KIVI) by :func:`kivi_attention_reference`,
which also applies llmd's read rule (each query's own block exact). In float64 it equals llmd's
int4 on SmolLM2; in float32, SmolLM2 int4 ΔNLL llmd 0.189 % vs 0.243 %, Gemma 3 3.328 % vs 3.333 %.

A single run is one *realization* of the rounding noise, and a chaotic one: a code that flips
in an early layer (its input one float32 ulp to either side of a rounding boundary, or one exact
tie) moves later layers' inputs across other boundaries. On SmolLM2 / this text, relative K/V
jitter of 1e-6 (≈ 8 float32 ulps) before quantizing gives, over 8 llmd runs, fp8_e4m3 ΔNLL
0.76 ± 0.15 % (0.58–1.09) and top-1 93.5 ± 0.3 %, int8 ΔNLL 0.005 ± 0.05 %; over 10 HF
fake-quant runs, fp8_e4m3 0.74 ± 0.18 %, fp8_e5m2 0.85 ± 0.25 % with top-1 86.1 ± 0.7 %. Two
correct implementations whose model-dtype runs agree to ~1e-6 therefore need not agree to
0.05 pp in quantized ΔNLL. On Gemma 3 270M (952 tokens of the same text; sliding-window layers
read through their own KV cache groups' block tables) the spread is wider: over 6 HF fake-quant
runs with the same jitter, ΔNLL int8 0.95 ± 0.18 %, fp8_e4m3 0.71 ± 0.27 %, fp8_e5m2
5.1 ± 0.8 %, nearly all of it from K (amax/rms 6-11 per 256-dim token vector).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.quant.kv import SCALE_FLOOR, KVCacheFormat, get_format
from llmd.quant.rotation import rotate

KV_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
#: the ``llmd bench kv-quality`` rows: every dtype, each without and with the rotation
BENCH_KV_DTYPES = (*KV_DTYPES, "int4")
ROTATIONS = ("none", "hadamard")


@dataclass
class QualityRow:
    """One KV dtype's result. ``delta_nll_pct`` = 100·(nll − nll_auto)/nll_auto; ``top1`` is
    the fraction of positions whose argmax equals the model-dtype run's; ``argmax`` ``[N - 1]``."""

    kv_cache_dtype: str
    bytes_per_token: int
    nll: float
    delta_nll_pct: float
    top1: float
    argmax: torch.Tensor = field(repr=False, default=None)
    kv_rotation: str = "none"
    kv_scale_group_size: int = 0

    @property
    def label(self) -> str:
        """``int8``, ``int8+hadamard``, ``int8/g32`` (grouped scales) or ``int8/g32+hadamard``."""
        group = f"/g{self.kv_scale_group_size}" if self.kv_scale_group_size else ""
        return self.kv_cache_dtype + group + ("" if self.kv_rotation == "none" else f"+{self.kv_rotation}")


def nll_and_argmax(logits: torch.Tensor, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Mean NLL of ``ids[1:]`` under ``logits[:-1]`` ``[N, vocab]``, and the argmax ``[N - 1]``."""
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    target = torch.tensor(ids[1:])
    return -lp.gather(1, target[:, None]).mean().item(), logits[:-1].argmax(-1)


def quality_row(model, tokenizer, ids: list[int], kv_cache_dtype: str, base: QualityRow | None = None,
                chunk: int = 64, cached_prefix: int = 0, **engine_kw) -> QualityRow:
    """Teacher-forced quality of one KV dtype on a loaded model, relative to ``base`` (the
    ``auto`` row; None = this run is the base). ``cached_prefix``: tokens served from the
    prefix cache (:meth:`Engine.teacher_forced_logits`). ``engine_kw``: EngineConfig fields (device,
    dtype, attention_backend, kv_cache_memory, kv_rotation (None = the dtype's default),
    kv_scale_group_size, ...)."""
    engine = Engine(model, tokenizer, EngineConfig(kv_cache_dtype=kv_cache_dtype, **engine_kw))
    nll, top = nll_and_argmax(engine.teacher_forced_logits(ids, chunk, cached_prefix), ids)
    base_nll, base_top = (nll, top) if base is None else (base.nll, base.argmax)
    return QualityRow(kv_cache_dtype, engine.bytes_per_token, nll, 100 * (nll - base_nll) / base_nll,
                      (top == base_top).float().mean().item(), top, engine.config.kv_rotation,
                      engine.config.kv_scale_group_size)


def kv_quality(model, tokenizer, ids: list[int], kv_dtypes=BENCH_KV_DTYPES, chunk: int = 64, cached_prefix: int = 0,
               kv_scales: tuple[float, float] | None = None, rotations=ROTATIONS, scale_groups=(0,),
               **engine_kw) -> list[QualityRow]:
    """:func:`quality_row` for ``auto`` and then each other dtype in ``kv_dtypes`` under each of
    ``scale_groups`` (``--kv-scale-group-size`` values, 8-bit dtypes only: int4, whose groups are
    its own, runs once when 0 is among them) and each of ``rotations`` (``--kv-rotation`` values; ``(None,)`` = each
    dtype's default); ``kv_scales`` (static per-tensor k, v scales) apply to the quantized dtypes,
    None = dynamic scales."""
    base = quality_row(model, tokenizer, ids, "auto", None, chunk, cached_prefix, **engine_kw)
    return [base] + [quality_row(model, tokenizer, ids, n, base, chunk, cached_prefix, kv_scales=kv_scales,
                                 kv_rotation=r, kv_scale_group_size=g, **engine_kw)
                     for n in kv_dtypes if n != "auto" for g in _row_groups(n, scale_groups) for r in rotations]


def _row_groups(kv_cache_dtype: str, scale_groups) -> tuple[int, ...]:
    """The ``--kv-scale-group-size`` values a dtype's rows run with: all of ``scale_groups`` for
    the 8-bit formats; int4 (its groups are its own) once, as 0, when 0 is among them."""
    if kv_cache_dtype != "int4":
        return tuple(scale_groups)
    return (0,) if 0 in scale_groups else ()


def fake_quant_reference(x: torch.Tensor, fmt: KVCacheFormat, rotation: str = "none") -> torch.Tensor:
    """Independent fake quantization from the spec, for the HF reference: per (token, KV head)
    (int4: per 16 channels, the scale clamped to float16's normal range and rounded to float16)
    ``scale = max(amax / qmax, SCALE_FLOOR)`` in float32, ``clamp(x / scale, ±qmax)``, torch's
    own cast to the fp8 dtype (round to nearest, ties to even) or ``torch.round`` for int8/int4,
    times the scale (the product taken exactly in float64, then rounded once to x's dtype:
    float32's own correctly rounded product for float32 models, the exact value for float64 ones).
    With a rotation ``H`` the result is ``Q(x H) H`` (``H H = I``): what llmd's rotated scores
    equal in exact arithmetic.

    For int4 (KIVI) this is V's scheme (per token, 16 channels); its K is
    :func:`kivi_keys_reference`.

    Args:
        x: ``[..., head_dim]`` float, quantized over the last dim.
    """
    if not fmt.quantized:
        return x
    xf = rotate(x.float() if x.dtype != torch.float64 else x, rotation).float()
    if fmt.group_size:
        xf = xf.unflatten(-1, (-1, fmt.group_size))
    scale = torch.clamp(xf.abs().amax(-1, keepdim=True) / fmt.qmax, min=SCALE_FLOOR)
    if fmt.scale_dtype == torch.float16:
        scale = scale.clamp(2.0**-14, 65504.0).half().float()
    y = torch.clamp(xf / scale, -fmt.qmax, fmt.qmax)
    codes = y.to(fmt.dtype).double() if fmt.is_fp8 else torch.round(y).double()
    out = (codes * scale.double()).flatten(-2) if fmt.group_size else codes * scale.double()
    return rotate(out, rotation).to(x.dtype)


def kivi_keys_reference(key: torch.Tensor, rotation: str = "none", block_size: int = 16,
                        residual_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 (KIVI, arXiv:2402.02750) K from the spec, for the HF reference: ``(exact, quantized)``.

    ``exact`` is what a query reads for keys of its own block: ``x H`` rounded once to the 16-bit
    ``residual_dtype`` (float16: clamped to ±65504 first), times ``H`` back. ``quantized`` is what
    it reads for keys of earlier blocks: per (head, block of ``block_size`` positions, channel) of
    those 16-bit values, ``scale = clamp((max - min) / 15, 2^-14, 65504)`` and ``zero = clamp(min,
    ±65504)`` rounded to float16, codes ``clamp(round((x - zero) / scale), 0, 15)`` (ties to even),
    value ``code · scale + zero`` taken in float64, times ``H`` back. Positions of a last, partial
    block keep their exact values there (no query reads them quantized).

    Args:
        key: ``[B, kv_heads, L, head_dim]`` after RoPE, positions ``0 .. L - 1``.
    Returns:
        Two tensors of ``key``'s shape and dtype.
    """
    x = rotate(key.float() if key.dtype != torch.float64 else key, rotation)
    if residual_dtype == torch.float16:
        x = x.clamp(-65504.0, 65504.0)
    x16 = x.to(residual_dtype).double()
    full = x16.shape[2] // block_size * block_size
    blocks = x16[:, :, :full].unflatten(2, (-1, block_size))  # [B, H, n, block_size, d]
    lo, hi = blocks.amin(3, keepdim=True), blocks.amax(3, keepdim=True)
    scale = ((hi - lo) / 15).clamp(2.0**-14, 65504.0).half().double()
    zero = lo.clamp(-65504.0, 65504.0).half().double()
    codes = torch.round((blocks - zero) / scale).clamp(0, 15)
    deq = torch.cat([(codes * scale + zero).flatten(2, 3), x16[:, :, full:]], 2)
    return rotate(x16, rotation).to(key.dtype), rotate(deq, rotation).to(key.dtype)


def kivi_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float, rotation: str = "none",
                             block_size: int = 16, softcap: float | None = None) -> torch.Tensor:
    """Attention with llmd's int4 read rule (one forward over positions ``0 .. L - 1``): the
    query at ``p`` scores keys of its own block ``p // block_size`` with the exact K and keys of
    earlier blocks with the dequantized K (:func:`kivi_keys_reference`); V is fake-quantized per
    token (:func:`fake_quant_reference`). Otherwise HF's eager attention: GQA by repeating K/V
    heads, ``scaling``, Gemma's ``softcap``, the mask (boolean: True attends; float: added;
    None: causal), softmax in float32 (float64 for a float64 model).

    Args:
        query: ``[B, heads, L, head_dim]``; key, value: ``[B, kv_heads, L, head_dim]``.
    Returns:
        ``[B, L, heads, head_dim]`` (HF's attention-function layout).
    """
    fmt = get_format("int4")
    exact, deq = kivi_keys_reference(key, rotation, block_size,
                                     getattr(torch, fmt.residual_dtype_name(query.dtype)))
    rep = query.shape[1] // key.shape[1]
    exact, deq = exact.repeat_interleave(rep, 1), deq.repeat_interleave(rep, 1)
    v = fake_quant_reference(value, fmt).repeat_interleave(rep, 1)
    n = key.shape[2]
    blk = torch.arange(n, device=query.device) // block_size
    own = blk[-query.shape[2]:, None] == blk[None, :]  # [L, L]: the key is in the query's block
    scores = torch.where(own, query @ exact.transpose(2, 3), query @ deq.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        attention_mask = torch.ones(query.shape[2], n, dtype=torch.bool, device=query.device).tril(n - query.shape[2])
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask[..., :n]
    probs = torch.softmax(scores, -1, dtype=torch.float64 if query.dtype == torch.float64 else torch.float32)
    return (probs.to(v.dtype) @ v).transpose(1, 2).contiguous()


HF_ATTN_NAME = "llmd_fake_quant"


@torch.inference_mode()
def hf_fake_quant(hf_model, ids: list[int], kv_cache_dtype: str, rotation: str = "none",
                  block_size: int = 16, scale_group_size: int = 0) -> tuple[float, torch.Tensor]:
    """Mean NLL and argmax ``[N - 1]`` (as :func:`nll_and_argmax`) from HF transformers with K
    (after RoPE) and V fake-quantized per (token, KV head) by :func:`fake_quant_reference`
    (per ``scale_group_size`` channels with ``--kv-scale-group-size``);
    int4 (KIVI) with llmd's read rule instead (:func:`kivi_attention_reference`: K per channel
    over blocks of ``block_size`` positions, each query's own block in 16 bits; V per token).

    The fake quantization is a registered attention function that wraps HF's own SDPA
    function (which takes the layer's ``scaling``: Gemma 3's ``query_pre_attn_scalar**-0.5``).
    Its mask function is registered as HF's ``sdpa_mask`` under the same name, so HF builds
    every layer's mask as it does for ``sdpa`` (causal, and Gemma 3's sliding window of its
    local layers); an attention name without a mask function would make HF skip the masks
    (transformers treats it as a paged backend), which SDPA's ``is_causal`` covers for
    full-attention models but silently drops sliding windows. ``kv_cache_dtype="auto"`` is
    the same path without quantization (the identity check). ``hf_model``: a decoder-only
    ``*ForCausalLM`` (Llama, Gemma 3); its attention implementation is restored afterwards.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    fmt = get_format(kv_cache_dtype, scale_group_size)

    def fake_quant_attention(module, query, key, value, attention_mask, **kw):
        # key/value: [B, kv_heads, L, head_dim] -> quantized over head_dim per (token, head);
        # kw carries the layer's scaling (and sliding_window, which the mask already encodes)
        if fmt.k_per_block:
            scaling = kw.get("scaling") or module.head_dim**-0.5
            return kivi_attention_reference(query, key, value, attention_mask, scaling, rotation, block_size,
                                            kw.get("softcap")), None
        key, value = fake_quant_reference(key, fmt, rotation), fake_quant_reference(value, fmt)  # llmd rotates K only
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(HF_ATTN_NAME, fake_quant_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(HF_ATTN_NAME, sdpa_mask)
    old = hf_model.config._attn_implementation
    hf_model.config._attn_implementation = HF_ATTN_NAME
    try:
        logits = hf_model(torch.tensor([ids])).logits[0]
    finally:
        hf_model.config._attn_implementation = old
    return nll_and_argmax(logits, ids)


def hf_fake_quant_nll(hf_model, ids: list[int], kv_cache_dtype: str, rotation: str = "none",
                      block_size: int = 16, scale_group_size: int = 0) -> float:
    """Mean NLL of :func:`hf_fake_quant` (the independent reference of case Q4)."""
    return hf_fake_quant(hf_model, ids, kv_cache_dtype, rotation, block_size, scale_group_size)[0]


def hf_reference_table(engine: Engine, ids: list[int], rows: list[QualityRow]) -> list[str]:
    """Lines of ``llmd bench kv-quality --hf-reference``: HF transformers' NLL on the same text
    (the GGUF's dequantized float32 weights, cast to the engine's dtype) and, per quantized row,
    llmd's ΔNLL beside HF's fake-quant ΔNLL (:func:`hf_fake_quant_nll`)."""
    import os

    from transformers import AutoModelForCausalLM

    from llmd.models.registry import resolve_model

    path = resolve_model(engine.config.model)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    hf = hf.to(engine.config.torch_dtype)  # float32 dequantized GGUF weights, cast as llmd's are
    with torch.inference_mode():
        base = nll_and_argmax(hf(torch.tensor([ids])).logits[0], ids)[0]
    lines = [f"HF transformers fake-quant reference: NLL {base:.4f} ({engine.config.dtype})"]
    for r in rows[1:]:
        ref = 100 * (hf_fake_quant_nll(hf, ids, r.kv_cache_dtype, r.kv_rotation, engine.config.block_size,
                                       r.kv_scale_group_size) - base) / base
        lines.append(f"{r.label:<23} ΔNLL llmd {r.delta_nll_pct:.3f}%  HF fake-quant {ref:.3f}%  "
                     f"|diff| {abs(r.delta_nll_pct - ref):.3f} pp")
    return lines


def format_table(rows: list[QualityRow]) -> list[str]:
    """Lines of the ``llmd bench kv-quality`` table."""
    lines = [f"{'kv dtype':<23}{'B/token':>9}{'mean NLL':>10}{'ΔNLL':>9}{'top-1 agree':>13}"]
    for r in rows:
        lines.append(f"{r.label:<23}{r.bytes_per_token:>9,}{r.nll:>10.4f}{r.delta_nll_pct:>8.3f}%"
                     f"{100 * r.top1:>12.2f}%")
    return lines
