"""A Llama-architecture bfloat16 forward on the CPU with the C layer glue fused across op
boundaries: per layer four matmuls (oneDNN, as before), the attention, and three C passes.

The generic layer (:class:`llmd.models.llama.LlamaDecoderLayer`, with
:data:`llmd.kernels.cpu_glue.active`) runs per layer: norm, QKV, RoPE, the K/V store (two
``index_copy_`` and a cast), the attention, O, add, norm, gate/up, SwiGLU, down, add, plus the
module calls, splits and views between them. At batch 32 these small steps cost ~4 ms of a ~50 ms
decode step on the 2-core Zen 4 (2026-12-06), nearly all call overhead. Here:

- the residual add and the next RMSNorm are one pass (:func:`llmd.kernels.cpu_glue.add_rms_norm`,
  vLLM's ``fused_add_rms_norm``): the residual stream is one tensor updated in place, and the last
  layer's MLP output is added and normed by the final norm in the same pass;
- RoPE of Q and K and the K/V store are one pass (:func:`llmd.kernels.cpu_glue.rope_store`);
- the projections are called directly (their module ``forward``, not ``nn.Module.__call__``).

Numerics: the same ops in the same order with the same roundings as the generic path under the
glue (bfloat16 add rounded once, the same norm, RoPE and SwiGLU passes, the same attention call),
so the outputs are identical bit for bit (``tests/models/test_glue_forward.py``).

It serves a forward when :func:`why_not` is None: a :class:`LlamaForCausalLM` (not a subclass with
its own layer forward, no per-head Q/K norm), bfloat16 weights, SiLU MLPs, the CPU, and every
layer's cache an ``auto`` bfloat16 cache without rotation whose planes are each contiguous.
Anything else takes the generic forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmd import kernels
from llmd.kernels import AttentionMetadata, cpu_glue
from llmd.models.layers import RMSNorm
from llmd.quant.kv import PagedKVCache, planes_contiguous


def why_not(model, kv_caches: list) -> str | None:
    """Why :func:`forward` cannot run ``model`` over ``kv_caches`` (None: it can)."""
    from llmd.models.llama import LlamaDecoderLayer

    if not cpu_glue.active:
        return "the C layer glue is off"
    if model.embed_tokens.weight.dtype != torch.bfloat16 or model.embed_tokens.weight.device.type != "cpu":
        return "not a bfloat16 model on the CPU"
    if type(model.norm) is not RMSNorm:
        return "not RMSNorm"
    for layer in model.layers:
        if not isinstance(layer, LlamaDecoderLayer) or type(layer).forward is not LlamaDecoderLayer.forward \
                or layer.qk_norm or layer.mlp.act is not F.silu:
            return "not a plain Llama layer"
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return "not RMSNorm"
    for cache in kv_caches:
        data = cache.data if isinstance(cache, PagedKVCache) else cache
        fmt = cache.fmt if isinstance(cache, PagedKVCache) else None
        if fmt is not None and (fmt.quantized or fmt.k_per_block or cache.rotation != "none"):
            return "a quantized or rotated KV cache"
        if data.dtype != torch.bfloat16 or not planes_contiguous(data):
            return "not a bfloat16 cache with contiguous planes"
    return None


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
    """:meth:`DecoderForCausalLM.forward` (``input_ids`` / ``positions`` ``[T]`` int64 → the final
    norm's output ``[T, hidden]`` bfloat16) for a model and caches :func:`why_not` accepts.

    Raises:
        RuntimeError: a glue pass refused its operands although :func:`why_not` accepted them.
    """
    cfg = model.config
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    res = model.embed(input_ids)  # the residual stream, updated in place from here on
    t = res.shape[0]
    tables = {th: model.rope_cache.lookup(positions, th, res.dtype) for th in dict.fromkeys(model.rope_thetas)}
    layers = model.layers
    h = _need(cpu_glue.rms_norm(res, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps))
    for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
        m = meta[i] if isinstance(meta, list) else meta
        attn, mlp = layer.self_attn, layer.mlp
        data = cache.data if isinstance(cache, PagedKVCache) else cache
        cos, sin = tables[model.rope_thetas[i]]
        q = _need(cpu_glue.rope_store(attn.qkv_proj.forward(h), heads, kv_heads, cos, sin, data, m.slot_mapping))
        o = kernels.paged_attention(q, cache, m, attn.scale, attn.sliding_window)
        y = attn.o_proj.forward(o.view(t, heads * d))
        norm = layer.post_attention_layernorm
        h = _need(cpu_glue.add_rms_norm(y, res, norm.weight, norm.eps))
        y = mlp.down_proj.forward(_need(cpu_glue.silu_mul(mlp.gate_up_proj.forward(h))))
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        h = _need(cpu_glue.add_rms_norm(y, res, norm.weight, norm.eps))
    return h


def _need(x: torch.Tensor | None) -> torch.Tensor:
    if x is None:
        raise RuntimeError("glue_forward: a C glue pass refused operands that why_not() accepted")
    return x
