"""A Llama-architecture bfloat16 or float32 forward on the CPU with the C layer glue fused across
op boundaries: per layer four matmuls (oneDNN, or fbgemm's fp16 packs), the attention, and three C
passes.

The generic layer (:class:`llmd.models.llama.LlamaDecoderLayer`, with
:data:`llmd.kernels.cpu_glue.active`) runs per layer: norm, QKV, RoPE, the K/V store (two
``index_copy_`` and a cast), the attention, O, add, norm, gate/up, SwiGLU, down, add, plus the
module calls, splits and views between them: at batch 32 ~6 ms of a ~57 ms SmolLM2 decode step on
the 2-core Zen 4 (2026-12-06), nearly all call overhead. Here:

- the residual add and the next RMSNorm are one pass (:func:`llmd.kernels.cpu_glue.add_rms_norm`,
  vLLM's ``fused_add_rms_norm``): the residual stream is one tensor updated in place, and the last
  layer's MLP output is added and normed by the final norm in the same pass;
- RoPE of Q and K and the K/V store are one pass (:func:`llmd.kernels.cpu_glue.rope_store`);
- the projections are called directly (their module ``forward``, not ``nn.Module.__call__``), and
  the C passes on the library itself, their operands' layouts checked once per step.

Numerics: the same ops in the same order with the same roundings as the generic path under the
glue (bfloat16 add rounded once, the same norm, RoPE and SwiGLU passes, the same attention call),
so the outputs are identical bit for bit (``tests/models/test_glue_forward.py``). Measured
alternately in one process (SmolLM2, decode steps over 512 cached tokens, 2-core Zen 4,
2026-12-06): the forward takes 0.90–0.92× the generic one's time at batch 32 (52.4 vs 56.6 ms;
53.4 vs 57.6) and 0.90× at batch 8 (22.7 vs 25.3 ms; 21.1 vs 23.8).

It serves a forward when :func:`why_not` is None: a :class:`LlamaForCausalLM` (not a subclass with
its own layer forward, no per-head Q/K norm), bfloat16 weights, SiLU MLPs, the CPU, and every
layer's cache with its planes each contiguous and either ``auto`` bfloat16 without rotation or
int8 with dynamic per-(token, KV head) scales (``--kv-cache-dtype int8``, any ``--kv-rotation``:
RoPE of Q and K in one pass, the rotation of K and Q as ``kernels.store_kv`` /
``kernels.paged_attention`` apply it, then K and V quantized as they are stored in one pass,
``llmd_store_int8``: the codes and scales of the torch store, which took ~3.7 ms of a batch-32
SmolLM2 step in ~10 small torch ops per layer). Anything else takes the generic forward.

**float32** (``kernels/native/layer_glue_f32.h``): the runner turns the glue on for a float32
model only beside the fp16 weight packs (:mod:`llmd.quant.fp16_linear`, what ``--dtype auto``
runs on a CPU without native bfloat16), whose products already leave float32's exact tokens; an
explicit ``--dtype float32`` keeps the torch layers and their exact float32 numerics. Caches:
``auto`` float32 or ``float16`` (that setup's default), no rotation. Its RoPE and K/V store are
torch's bits; the norm (Σx² in double) and SiLU differ by float32 ulps, so the logits are within
float32 rounding of the generic layers', not equal (``tests/models/test_glue_forward.py``).
Measured alternately in one process (SmolLM2, fp16 packs, float16 cache, decode steps, 2-core
Zen 3, 2026-12-06): 0.90× the generic forward's time at batch 32 × 512 (90.3 vs 100.0 ms), 0.80×
at 8 × 256 (33.8 vs 42.4), 0.91× for 256 one-token sequences (381 vs 419).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from llmd import kernels
from llmd.kernels import AttentionMetadata, cpu_attention, cpu_glue
from llmd.kernels.native import build
from llmd.models.layers import RMSNorm
from llmd.quant.kv import SCALE_FLOOR, PagedKVCache, planes_contiguous
from llmd.quant.rotation import rotate


def why_not(model, kv_caches: list, check_active: bool = True) -> str | None:
    """Why :func:`forward` cannot run ``model`` over ``kv_caches`` (None: it can).
    ``check_active=False`` leaves out whether the C layer glue is on right now (the runner turns
    it on around its forwards). ``LLMD_GLUE_FORWARD=0`` turns this forward off alone (the generic
    layers then run under the same C passes: the A/B switch for its bits and its speed)."""
    from llmd.models.llama import LlamaDecoderLayer

    if os.environ.get("LLMD_GLUE_FORWARD", "1") == "0":
        return "LLMD_GLUE_FORWARD=0"
    if check_active and not cpu_glue.active:
        return "the C layer glue is off"
    dtype = model.embed_tokens.weight.dtype
    if dtype not in (torch.bfloat16, torch.float32) or model.embed_tokens.weight.device.type != "cpu":
        return "not a bfloat16 or float32 model on the CPU"
    if type(model.norm) is not RMSNorm:
        return "not RMSNorm"
    for layer in model.layers:
        if not isinstance(layer, LlamaDecoderLayer) or type(layer).forward is not LlamaDecoderLayer.forward \
                or layer.qk_norm or layer.mlp.act is not F.silu:
            return "not a plain Llama layer"
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return "not RMSNorm"
    hidden = model.config.hidden_size
    norms = [model.norm] + [n for la in model.layers for n in (la.input_layernorm, la.post_attention_layernorm)]
    for norm in norms:
        w = norm.weight
        if w.dtype != dtype or not w.is_contiguous() or w.shape != (hidden,):
            return "RMSNorm weights not contiguous [hidden] in the model's dtype"
    for cache in kv_caches:
        data = cache.data if isinstance(cache, PagedKVCache) else cache
        fmt = cache.fmt if isinstance(cache, PagedKVCache) else None
        if data.dim() != 5 or data.shape[3:] != (model.config.num_kv_heads, model.config.head_dim) \
                or not planes_contiguous(data):
            return "a cache without contiguous planes"
        if dtype == torch.float32:
            if fmt is not None and (fmt.quantized or cache.rotation != "none") or \
                    data.dtype not in (torch.float32, torch.float16):
                return "a float32 model's cache other than float32 or float16 without rotation"
            continue
        if fmt is not None and fmt.quantized and not cpu_glue.int8_store_ok(cache):
            return "a quantized KV cache other than int8 with dynamic scales"
        if fmt is not None and cache.rotation != "none" and not fmt.quantized:
            return "a rotated bfloat16 KV cache"
        if data.dtype not in (torch.bfloat16, torch.int8) \
                or (data.dtype == torch.int8) != bool(fmt is not None and fmt.quantized):
            return "not a bfloat16 or int8 cache"
    return None


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
    """:meth:`DecoderForCausalLM.forward` (``input_ids`` / ``positions`` ``[T]`` int64 → the final
    norm's output ``[T, hidden]`` bfloat16) for a model and caches :func:`why_not` accepts.

    The glue passes are called on the library directly (``kernels/native/layer_glue.c``, the
    functions behind :mod:`llmd.kernels.cpu_glue`): the operands' layouts are checked once here
    and per projection output (:func:`_rows_of`), not by the wrappers in every call (~10 µs each).

    Raises:
        RuntimeError: an operand not in the layout the passes take (a projection's output not
            contiguous bfloat16 of the expected width, a slot mapping not contiguous int64).
    """
    cfg = model.config
    heads, kv_heads, d, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    width, inter = (heads + 2 * kv_heads) * d, cfg.intermediate_size
    lib, threads = build.load_glue(), torch.get_num_threads()
    if lib is None:
        raise RuntimeError("glue_forward: the glue library went away")
    dtype = model.embed_tokens.weight.dtype
    f32 = dtype == torch.float32
    rms_norm = lib.llmd_rms_norm_f32 if f32 else lib.llmd_rms_norm_bf16
    add_rms_norm = lib.llmd_add_rms_norm_f32 if f32 else lib.llmd_add_rms_norm_bf16
    silu_mul = lib.llmd_silu_mul_f32 if f32 else lib.llmd_silu_mul_bf16
    res = model.embed(input_ids)  # the residual stream (a new tensor), updated in place from here on
    t = res.shape[0]
    if res.dtype != dtype or res.shape != (t, hidden) or not res.is_contiguous():
        raise RuntimeError("glue_forward: the embedding's output is not a contiguous [T, hidden] of the model dtype")
    norm = model.layers[0].input_layernorm
    h = torch.empty((t, hidden), dtype=dtype)
    rms_norm(res.data_ptr(), hidden, norm.weight.data_ptr(), t, hidden, norm.eps, h.data_ptr(), threads)
    ropes = rope_rows(model, positions, t)
    layers = model.layers
    for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
        m = meta[i] if isinstance(meta, list) else meta
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _rows_of(attn.qkv_proj.forward(h), t, width, dtype)
        o = attention(lib, threads, cfg, attn, qkv, ropes[model.rope_thetas[i]], cache, m)
        y = _rows_of(attn.o_proj.forward(o.view(t, heads * d)), t, hidden, dtype)
        norm = layer.post_attention_layernorm
        h = torch.empty((t, hidden), dtype=dtype)
        add_rms_norm(y.data_ptr(), hidden, res.data_ptr(), norm.weight.data_ptr(), t, hidden, norm.eps,
                                   h.data_ptr(), threads)
        gate_up = _rows_of(mlp.gate_up_proj.forward(h), t, 2 * inter, dtype)
        act = torch.empty((t, inter), dtype=dtype)
        silu_mul(gate_up.data_ptr(), 2 * inter, t, inter, act.data_ptr(), threads)
        y = _rows_of(mlp.down_proj.forward(act), t, hidden, dtype)
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        h = torch.empty((t, hidden), dtype=dtype)
        add_rms_norm(y.data_ptr(), hidden, res.data_ptr(), norm.weight.data_ptr(), t, hidden, norm.eps,
                                   h.data_ptr(), threads)
    return h


def rope_rows(model, positions: torch.Tensor, t: int) -> dict:
    """Per RoPE base of ``model``: ``(cos pointer, its row stride, sin pointer, its row stride,
    cos, sin)`` of the step's ``[T, head_dim]`` table rows (:class:`RopeCache`; the tensors kept
    so the pointers stay valid). Raises RuntimeError if the rows are not contiguous."""
    ropes, d, dtype = {}, model.config.head_dim, model.embed_tokens.weight.dtype
    for th in dict.fromkeys(model.rope_thetas):
        cos, sin = (c[:, 0] for c in model.rope_cache.lookup(positions, th, dtype))  # [T, d] rows
        if cos.shape != (t, d) or sin.shape != (t, d) or cos.stride(1) != 1 or sin.stride(1) != 1:
            raise RuntimeError("glue_forward: RoPE tables not [T, 1, head_dim] with contiguous rows")
        ropes[th] = (cos.data_ptr(), cos.stride(0), sin.data_ptr(), sin.stride(0), cos, sin)
    return ropes


def attention(lib, threads: int, cfg, attn, qkv: torch.Tensor, rope: tuple, cache, meta: AttentionMetadata):
    """One layer's attention from its QKV projection ``qkv [T, (heads + 2 kv_heads) · head_dim]``
    (contiguous bfloat16): RoPE of Q and K with the K/V store in one pass
    (``llmd_rope_store_bf16``; for an int8 cache RoPE, the cache's rotation of K, and the
    quantizing store ``llmd_store_int8``), then ``kernels.paged_attention`` over ``cache`` (for a
    step of decodes only, the C kernel's call bound to the step once,
    :func:`cpu_attention.decode_call`, with the query rotated as that function would rotate it).
    ``rope``: this layer's entry of :func:`rope_rows`. Returns ``[T, heads, head_dim]`` bfloat16.
    What ``llmd bench step`` times as the attention of a step this forward runs.

    Raises:
        RuntimeError: a slot mapping that is not contiguous int64 ``[T]``.
    """
    t, heads, kv_heads, d = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    data = cache.data if isinstance(cache, PagedKVCache) else cache
    slots = meta.slot_mapping
    if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape[0] != t:
        raise RuntimeError("glue_forward: the slot mapping is not contiguous int64 [T]")
    if data.dtype == torch.int8:  # RoPE, the cache's rotation of K (and Q), then K and V quantized as stored
        qk = torch.empty((t, heads + kv_heads, d), dtype=torch.bfloat16)
        lib.llmd_rope_bf16(qkv.data_ptr(), qkv.shape[1], t, heads + kv_heads, d, *rope[:4], qk.data_ptr(), threads)
        q, k = qk[:, :heads], rotate(qk[:, heads:], cache.rotation)  # as kernels.store_kv rotates K
        v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
        lib.llmd_store_int8(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), t, kv_heads, d, data.data_ptr(),
                            data.stride(0), cache.scales.data_ptr(), cache.scales.stride(0), slots.data_ptr(),
                            SCALE_FLOOR, threads)
    elif qkv.dtype == torch.float32:  # K and V stored as float32, or rounded to a float16 cache
        q = torch.empty((t, heads, d), dtype=torch.float32)
        lib.llmd_rope_store_f32(qkv.data_ptr(), qkv.shape[1], t, heads, kv_heads, d, *rope[:4], q.data_ptr(),
                                data.data_ptr(), data.stride(0), slots.data_ptr(), int(data.dtype == torch.float16),
                                threads)
    else:
        q = torch.empty((t, heads, d), dtype=torch.bfloat16)
        lib.llmd_rope_store_bf16(qkv.data_ptr(), qkv.shape[1], t, heads, kv_heads, d, *rope[:4], q.data_ptr(),
                                 data.data_ptr(), data.stride(0), slots.data_ptr(), threads)
    if meta.attn_backend == "cpu":  # a decode-only step: the C kernel's call bound once for all layers
        call = cpu_attention.decode_call(meta, cache, heads, qkv.dtype, attn.scale, attn.sliding_window)
        if call is not None:  # the query rotated as kernels.paged_attention rotates it
            return call(rotate(q, cache.rotation if data.dtype == torch.int8 else "none"), cache)
    return kernels.paged_attention(q, cache, meta, attn.scale, attn.sliding_window)


def _rows_of(y: torch.Tensor, t: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``y`` when it is a contiguous ``[t, n]`` of ``dtype`` (a projection's output), else RuntimeError."""
    if y.dtype != dtype or y.shape != (t, n) or not y.is_contiguous():
        raise RuntimeError(f"glue_forward: a projection gave {tuple(y.shape)} {y.dtype}, not contiguous {dtype} "
                           f"[{t}, {n}]")
    return y
