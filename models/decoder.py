"""The decoder-only causal LM skeleton the model files share: token embedding, a stack of
decoder layers over the paged KV cache, final norm, (tied) LM head, and the GGUF tensor map.

An architecture subclasses :class:`DecoderForCausalLM` and sets ``layer_cls`` (its decoder
block), ``norm_cls`` (its final RMSNorm) and ``layer_tensors`` (GGUF per-layer tensor stem →
parameter path inside a block, llama.cpp's names), and may override ``embed`` and
``transform_gguf_tensor``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmd.kernels import AttentionMetadata
from llmd.models.config import ModelConfig


class DecoderForCausalLM(nn.Module):
    """Decoder over a flattened batch of tokens.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches: one cache per layer, meta)
    -> hidden [T, hidden_size]`` where ``meta`` is one :class:`AttentionMetadata` for all layers
    or a list with one per layer (layers of different KV cache groups have their own block
    tables); ``compute_logits(hidden [N, hidden]) -> [N, vocab] float32``.
    """

    layer_cls: type[nn.Module]
    norm_cls: type[nn.Module]
    layer_tensors: dict[str, str] = {}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device="meta")
        self.embed_tokens.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)

    def gguf_tensor_map(self) -> dict[str, str]:
        """GGUF tensor name → parameter name, for every tensor this architecture reads."""
        m = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
        if self.lm_head is not None:
            m["output.weight"] = "lm_head"
        for i in range(self.config.num_layers):
            for g, p in self.layer_tensors.items():
                m[f"blk.{i}.{g}.weight"] = f"layers.{i}.{p}"
        return m

    def transform_gguf_tensor(self, name: str, w: np.ndarray) -> np.ndarray:
        """Per-architecture fix-ups applied after dequantization (none by default)."""
        return w

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]``."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        x = self.embed(input_ids)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, positions, cache, meta[i] if isinstance(meta, list) else meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return (hidden @ w.t()).float()
