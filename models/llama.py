"""Llama-architecture decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral without window) from GGUF.

Reference: HF transformers ``modeling_llama.py``; GGUF tensor names from llama.cpp
(``gguf.constants.MODEL_TENSORS[MODEL_ARCH.LLAMA]``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

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

    def transform_gguf_tensor(self, name: str, w: np.ndarray) -> np.ndarray:
        """Per-architecture fix-ups applied after dequantization (Q/K un-permutation)."""
        if name.endswith("attn_q.weight"):
            return unpermute_qk(w, self.config.num_heads)
        if name.endswith("attn_k.weight"):
            return unpermute_qk(w, self.config.num_kv_heads)
        return w
