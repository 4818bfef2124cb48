"""Gemma 3 text decoder (e.g. Gemma 3 270M) from GGUF.

Reference: HF transformers ``models/gemma3/modeling_gemma3.py`` (``Gemma3ForCausalLM``); GGUF
tensor names from llama.cpp (``gguf.constants.MODEL_TENSORS[MODEL_ARCH.GEMMA3]``).

Differences from Llama: per-head RMSNorm on Q and K before RoPE; RMSNorm before *and after*
attention and the MLP (sandwich norms); embeddings multiplied by ``sqrt(hidden_size)`` cast to
the activation dtype; GELU (tanh) gated MLP; local layers with a sliding window and their own
RoPE base, global layers with full attention (see :class:`~llmd.models.config.ModelConfig`);
tied embeddings. GGUF quirks: norm weights already include Gemma's ``+1`` (used as stored); Q/K
rows are *not* permuted (llama.cpp runs Gemma with NEOX RoPE, like HF).
"""

from __future__ import annotations

import torch
from torch import nn

from llmd.models.config import ModelConfig
from llmd.models.decoder import DecoderForCausalLM
from llmd.models.layer_tensors import GEMMA3
from llmd.models.layers import GatedMLP, GemmaRMSNorm, PagedAttention

# GGUF per-layer tensor stem → parameter path inside a Gemma3DecoderLayer, or (fused module, part).
LAYER_TENSORS = GEMMA3


class Gemma3DecoderLayer(nn.Module):
    """One Gemma 3 block: ``x + post_norm(attn(pre_norm(x)))``, then the same around the MLP.

    ``forward(x [T, hidden], rope (cos, sin) [T, 1, head_dim], kv_cache, meta) -> [T, hidden]``.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.self_attn = PagedAttention(
            h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.layer_rope_theta(layer_idx), dtype,
            sliding_window=cfg.layer_window(layer_idx), qk_norm_eps=eps, scale=cfg.softmax_scale,
            norm_cls=GemmaRMSNorm,
        )
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = GatedMLP(h, cfg.intermediate_size, dtype, "gelu_tanh")
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 decoder (see :class:`DecoderForCausalLM` for the interface): scaled embeddings,
    Gemma RMSNorms, no tensor fix-ups (Q/K stored unpermuted, norms already include the +1)."""

    layer_cls = Gemma3DecoderLayer
    norm_cls = GemmaRMSNorm
    layer_tensors = LAYER_TENSORS

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` × ``embedding_scale`` (scale rounded to float32, then to x's dtype,
        as HF does)."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.config.embedding_scale, dtype=torch.float32, device=x.device).to(x.dtype)
