"""The decoder-only causal LM skeleton the model files share: token embedding, a stack of
decoder layers over the paged KV cache, final norm, (tied) LM head, and the GGUF tensor map.

An architecture subclasses :class:`DecoderForCausalLM` and sets ``layer_cls`` (its decoder
block, ``forward(x, rope, kv_cache, meta)``), ``norm_cls`` (its final RMSNorm) and
``layer_tensors`` (GGUF per-layer tensor stem → where it lands inside a block, llama.cpp's
names: a parameter path, or ``(module path, part)`` for one part of a
:class:`~llmd.models.layers.MergedLinear`), and may override ``embed`` and
``transform_gguf_tensor``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from llmd.kernels import AttentionMetadata
from llmd.models.config import ModelConfig
from llmd.models.layers import MergedLinear, rope_tables


class Slot(NamedTuple):
    """Where one GGUF tensor lands: rows ``[start, stop)`` of parameter ``param`` (a part of a
    fused projection), or the whole parameter when ``rows`` is None."""

    param: str
    rows: tuple[int, int] | None = None

    def of(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The slot's tensor (a view) among ``dict(model.named_parameters())``."""
        p = params[self.param].data
        return p if self.rows is None else p[self.rows[0] : self.rows[1]]


class RopeCache:
    """RoPE tables of positions ``0 .. length - 1`` per (base, dtype) on the CPU, built once by
    :func:`rope_tables` and doubled when a step reaches past them (from 4,096 positions: 1 MiB in
    bfloat16 at head_dim 64); a step gathers its rows in one ``index_select`` instead of computing
    its angles, cos and sin (~14 small kernels: 263 µs of a batch-1 decode step, in the model on one
    thread). Other devices compute :func:`rope_tables` per step.

    ``lookup(positions [T] int64, theta, dtype) -> (cos, sin)``, each ``[T, 1, head_dim]`` (views
    of one ``[T, 2, head_dim]`` gather), equal to ``rope_tables(positions, head_dim, theta, dtype)``.
    """

    MIN_LENGTH = 4096

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.tables: dict = {}  # (theta, dtype) -> [length, 2, head_dim]: cos, then sin with its first half negated

    def lookup(self, positions: torch.Tensor, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device.type != "cpu":
            return rope_tables(positions, self.head_dim, theta, dtype)
        table = self.tables.get((theta, dtype))
        last = int(positions.max()) if positions.numel() else 0
        if table is None or last >= table.shape[0]:
            length = max(self.MIN_LENGTH, 1 << last.bit_length(), 0 if table is None else 2 * table.shape[0])
            cos, sin = rope_tables(torch.arange(length), self.head_dim, theta, dtype)
            table = self.tables[(theta, dtype)] = torch.cat((cos, sin), 1)
        rows = table.index_select(0, positions)
        return rows[:, :1], rows[:, 1:]


class DecoderForCausalLM(nn.Module):
    """Decoder over a flattened batch of tokens.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches: one cache per layer, meta)
    -> hidden [T, hidden_size]`` where ``meta`` is one :class:`AttentionMetadata` for all layers
    or a list with one per layer (layers of different KV cache groups have their own block
    tables); ``compute_logits(hidden [N, hidden]) -> [N, vocab] float32``. The RoPE tables
    (``[T, 1, head_dim]`` cos and sin in the activation dtype) are looked up once per step for each
    distinct RoPE base (``cfg.layer_rope_theta(i)``; Gemma 3 has a local and a global one) and
    handed to the layers: on the CPU one ``index_select`` from :class:`RopeCache` (the tables of
    every position so far, built by :func:`rope_tables`: the same values bit for bit), elsewhere
    :func:`rope_tables` of the step's positions (capture-friendly for CUDA graphs).
    """

    layer_cls: type[nn.Module]
    norm_cls: type[nn.Module]
    layer_tensors: dict[str, str | tuple[str, str]] = {}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        # ``_weight`` skips nn.Embedding's random init (normal_ on a meta tensor imports torch._dynamo: ~4 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _freeze=True,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.rope_thetas = [cfg.layer_rope_theta(i) for i in range(cfg.num_layers)]
        self.rope_cache = RopeCache(cfg.head_dim)
        self.logits_proj: nn.Module | None = None  # a packed lm_head (``--weight-quant``), else the dense one

    def gguf_tensor_map(self) -> dict[str, Slot]:
        """GGUF tensor name → its :class:`Slot`, for every tensor this architecture reads. The
        slots of each parameter cover its rows exactly once (checked by the loader)."""
        m = {"token_embd.weight": Slot("embed_tokens.weight"), "output_norm.weight": Slot("norm.weight")}
        if self.lm_head is not None:
            m["output.weight"] = Slot("lm_head")
        for i in range(self.config.num_layers):
            for g, p in self.layer_tensors.items():
                if isinstance(p, tuple):
                    fused: MergedLinear = self.get_submodule(f"layers.{i}.{p[0]}")
                    m[f"blk.{i}.{g}.weight"] = Slot(f"layers.{i}.{p[0]}.weight", fused.rows[p[1]])
                else:
                    m[f"blk.{i}.{g}.weight"] = Slot(f"layers.{i}.{p}")
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
        tables = {th: self.rope_cache.lookup(positions, th, x.dtype) for th in dict.fromkeys(self.rope_thetas)}
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, tables[self.rope_thetas[i]], cache, meta[i] if isinstance(meta, list) else meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_proj is not None:
            return self.logits_proj(hidden).float()
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return (hidden @ w.t()).float()
