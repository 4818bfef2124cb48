"""KV cache capacity math from a :class:`ModelConfig` alone (no weights loaded).

bytes/token = 2 · layers · kv_heads · (head_dim · bytes_per_element + scale_bytes), where the
8-bit formats store one float32 scale per (token, KV head) for K and for V (the scale layout
of :mod:`llmd.quant.kv`). SmolLM2 (30 layers, 3 KV heads × 64): 23,040 B/token in 16-bit,
12,240 with int8/fp8 + float32 scales (1.88× the tokens in the same memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmd.models.config import ModelConfig
from llmd.quant.kv import get_format

#: (name, bytes per element, scale bytes per (token, KV head) for each of K and V)
KV_FORMATS = [("float32", 4, 0), ("bf16/fp16", 2, 0), ("fp8", 1, 4), ("int8", 1, 4)]


@dataclass(frozen=True)
class KVSizeRow:
    """One KV cache dtype's capacity.

    Attributes:
        name: format name.
        bytes_per_token: KV bytes per token (scales included).
        bytes_per_sequence: bytes for one ``context``-token sequence.
        num_blocks: ``floor(memory / (block_size × bytes_per_token))``.
        sequences: full-context sequences that fit (``num_blocks × block_size / context``).
    """

    name: str
    bytes_per_token: int
    bytes_per_sequence: int
    num_blocks: int
    sequences: float


def kv_bytes_per_token(cfg: ModelConfig, element_bytes: int, scale_bytes: int = 0) -> int:
    """2 · layers · kv_heads · (head_dim · element_bytes + scale_bytes), in bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * element_bytes + scale_bytes)


def kv_cache_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes per token of the cache ``--kv-cache-dtype`` allocates (scales included)."""
    fmt = get_format(kv_cache_dtype)
    return kv_bytes_per_token(cfg, fmt.bytes_per_element(model_dtype), fmt.scale_bytes)


def kv_size_rows(cfg: ModelConfig, context: int, memory: int, block_size: int) -> list[KVSizeRow]:
    """Capacity of a ``memory``-byte KV cache for each format in :data:`KV_FORMATS`.

    Args:
        context: tokens per sequence; memory: bytes; block_size: tokens per block.
    """
    rows = []
    for name, elem, scale in KV_FORMATS:
        bpt = kv_bytes_per_token(cfg, elem, scale)
        blocks = memory // (block_size * bpt)
        rows.append(KVSizeRow(name, bpt, bpt * context, blocks, blocks * block_size / context))
    return rows
