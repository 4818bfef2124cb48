"""Llama-architecture decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral without window) from GGUF.

Reference: HF transformers ``modeling_llama.py``; GGUF tensor names from llama.cpp
(``gguf.constants.MODEL_TENSORS[MODEL_ARCH.LLAMA]``).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import nn

from llmd.kernels import cpu_glue
from llmd.models import glue_forward
from llmd.models.config import ModelConfig
from llmd.models.decoder import DecoderForCausalLM
from llmd.models.layer_tensors import LLAMA
from llmd.models.layers import GatedMLP, PagedAttention, RMSNorm


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    llama.cpp stores each head's rows interleaved for its pairwise RoPE; HF / NEOX rotate-half
    needs the halves contiguous. ``w``: ``[n_head * head_dim, in]`` → same shape.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm Llama block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    ``forward(x [T, hidden], rope (cos, sin) [T, 1, head_dim], kv_cache, meta) -> [T, hidden]``.
    """

    qk_norm = False  # per-head RMSNorm of Q and K before RoPE (Qwen3)

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = PagedAttention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.layer_rope_theta(layer_idx), dtype,
            sliding_window=cfg.layer_window(layer_idx), scale=cfg.softmax_scale,
            qk_norm_eps=cfg.rms_norm_eps if self.qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, "silu")

    def forward(self, x, rope, kv_cache, meta):
        m = self._modules  # not nn.Module.__getattr__ (models/layers.py: ~1.4 µs per lookup)
        x = x + m["self_attn"](m["input_layernorm"](x), rope, kv_cache, meta)
        return x + m["mlp"](m["post_attention_layernorm"](x))


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama decoder (see :class:`DecoderForCausalLM` for the interface); undoes llama.cpp's
    Q/K row permutation on load (per GGUF tensor, before its rows land in ``qkv_proj``)."""

    layer_cls = LlamaDecoderLayer
    norm_cls = RMSNorm
    layer_tensors = LLAMA

    def forward(self, input_ids, positions, kv_caches, meta):
        """:meth:`DecoderForCausalLM.forward`; with the C layer glue on, through
        :mod:`llmd.models.glue_forward` when it serves these caches (the same bits, fewer passes)."""
        if cpu_glue.active:
            refs = self._glue_refs
            if len(refs) != len(kv_caches) or any(r() is not c for r, c in zip(refs, kv_caches)):
                self._glue_ok = glue_forward.why_not(self, kv_caches) is None
                self._glue_refs = [weakref.ref(c) for c in kv_caches]
            if self._glue_ok:
                return glue_forward.forward(self, input_ids, positions, kv_caches, meta)
        return super().forward(input_ids, positions, kv_caches, meta)

    _glue_refs: list = []  # weak references to the caches glue_forward.why_not() last judged, and its verdict
    _glue_ok = False

    def transform_gguf_tensor(self, name: str, w: np.ndarray) -> np.ndarray:
        """Per-architecture fix-ups applied after dequantization (Q/K un-permutation)."""
        if name.endswith("attn_q.weight"):
            return unpermute_qk(w, self.config.num_heads)
        if name.endswith("attn_k.weight"):
            return unpermute_qk(w, self.config.num_kv_heads)
        return w

    def fused_decoder(self, layer_caches: list, block_size: int):
        """The single-stream decode of this model in one C call (:class:`llmd.kernels.cpu_fused.FusedDecoder`)
        over ``layer_caches`` (one :class:`~llmd.quant.kv.PagedKVCache` per layer), or the reason it
        cannot run (a string): it needs the fused kernel's weight packs (``--weight-quant auto`` /
        ``gguf`` on CPU), ``auto`` caches, no per-head Q/K norm, one RoPE base and the kernel's limits."""
        from llmd.kernels import cpu_fused
        from llmd.quant.packed_linear import PackedLinear

        cfg = self.config
        if self.layer_cls.qk_norm:
            return "per-head Q/K norms (not in the fused kernel)"
        if len(set(self.rope_thetas)) != 1:
            return "more than one RoPE base"
        if len(set(cfg.layer_windows)) != 1:  # the kernel walks one block table for every layer
            return "more than one KV cache group (layers with different sliding windows)"
        if self.embed_tokens.weight.dtype not in (torch.float32, torch.bfloat16):
            return f"model dtype {self.embed_tokens.weight.dtype} (needs float32 or bfloat16)"
        if any(c.fmt.quantized or c.fmt.k_per_block or c.rotation != "none" for c in layer_caches):
            return ("a quantized or rotated KV cache (needs --kv-cache-dtype auto, float16 or bfloat16, "
                    "--kv-rotation none)")

        def pack(mod):
            return mod.native_pack() if isinstance(mod, PackedLinear) else None

        layers, mats = [], []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            parts = [pack(attn.qkv_proj), pack(attn.o_proj), pack(mlp.gate_up_proj), pack(mlp.down_proj)]
            mats += parts
            layers.append(cpu_fused.FusedLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                               *parts, kv=layer_caches[i].data, window=cfg.layer_window(i)))
        head = pack(self.logits_proj) if self.logits_proj is not None else None
        reason = cpu_fused.why_not(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, block_size, layer_caches[0].data, mats + [head])
        if reason is None and not cpu_fused.available(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads):
            from llmd.kernels.native import build

            reason = build.fused_why_not or "the fused kernel did not build"
        if reason is not None:
            return reason
        return cpu_fused.FusedDecoder(layers, self.norm.weight, head, self.embed_tokens.weight, cfg.num_heads,
                                      cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, self.layers[0].self_attn.scale,
                                      self.rope_thetas[0], block_size)
