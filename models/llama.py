"""Llama-architecture decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral without window) from GGUF.

Reference: HF transformers ``modeling_llama.py``; GGUF tensor names from llama.cpp
(``gguf.constants.MODEL_TENSORS[MODEL_ARCH.LLAMA]``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmd.kernels import AttentionMetadata
from llmd.models.config import ModelConfig
from llmd.models.layers import GatedMLP, PagedAttention, RMSNorm


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    llama.cpp stores each head's rows interleaved for its pairwise RoPE; HF / NEOX rotate-half
    needs the halves contiguous. ``w``: ``[n_head * head_dim, in]`` → same shape.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = PagedAttention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.layer_rope_theta(layer_idx), dtype,
            sliding_window=cfg.layer_window(layer_idx), scale=cfg.softmax_scale,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, "silu")

    def forward(self, x, positions, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder over a flattened batch of tokens.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches: list of per-layer caches,
    meta) -> hidden [T, hidden_size]``; ``compute_logits(hidden [N, hidden]) -> [N, vocab] float32``.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device="meta")
        self.embed_tokens.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)

    def gguf_tensor_map(self) -> dict[str, str]:
        """GGUF tensor name → parameter name, for every tensor this architecture reads."""
        m = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
        if self.lm_head is not None:
            m["output.weight"] = "lm_head"
        names = {
            "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
            "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
            "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
            "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight", "ffn_down": "mlp.down_proj.weight",
        }
        for i in range(self.config.num_layers):
            for g, p in names.items():
                m[f"blk.{i}.{g}.weight"] = f"layers.{i}.{p}"
        return m

    def transform_gguf_tensor(self, name: str, w: np.ndarray) -> np.ndarray:
        """Per-architecture fix-ups applied after dequantization (Q/K un-permutation)."""
        if name.endswith("attn_q.weight"):
            return unpermute_qk(w, self.config.num_heads)
        if name.endswith("attn_k.weight"):
            return unpermute_qk(w, self.config.num_kv_heads)
        return w

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """``meta``: one AttentionMetadata shared by all layers, or a list with one per layer."""
        x = self.embed(input_ids)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, positions, cache, meta[i] if isinstance(meta, list) else meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return (hidden @ w.t()).float()
