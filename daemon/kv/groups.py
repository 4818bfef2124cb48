"""KV cache groups: layers grouped by attention type over one shared block pool.

vLLM's hybrid KV cache manager (`vllm/v1/core/kv_cache_utils.py`, ``_get_kv_cache_config_
uniform_page_size``; `vllm/v1/core/single_type_kv_cache_manager.py`): layers with the same
attention type (full attention, or a sliding window of ``W`` tokens) are cut into groups of
equal size ``group_size``. Every group has its own block table per request, and all groups
draw blocks from one pool. Physically there are ``group_size`` cache tensors; layer ``k`` of
every group uses tensor ``k``, so a block id means the same memory slice in each group's
layers and one block costs ``group_size`` layers of K/V. Gemma 3 270M (15 local layers with
W = 512, layers 5, 11 and 17 global) gives 1 full-attention group and 5 sliding-window
groups of 3 layers each.

A sliding-window group frees a request's block once no current or future query can see it
(its last token is < ``p - W + 1`` for the first query position ``p``), leaving the null
block in the table.

We chose vLLM's shared pool over per-type pools with a fixed split: the split would have to
be guessed per workload, while a shared pool lets the full group take whatever the sliding
groups do not hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group.

    Attributes:
        name: ``"full_attention"`` or ``"sliding_window_<W>"``, suffixed ``.<k>`` when a type has several groups.
        layer_ids: model layer indices in the group (all the same attention type).
        sliding_window: ``W`` in tokens, or None for full attention.
    """

    name: str
    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    def max_blocks(self, num_tokens: int, block_size: int, chunk_size: int) -> int:
        """Most blocks this group ever holds for one sequence of ``num_tokens`` tokens.

        Full attention: ``ceil(num_tokens / block_size)``. A sliding window ``W``, prefilled
        in chunks of at most ``chunk_size`` tokens: the tokens a step can see span
        ``W - 1 + C`` positions, so ``min(ceil(num_tokens / bs), ceil((W - 1 + C) / bs) + 1)``
        with ``C = min(chunk_size, num_tokens)`` (C = 1 gives the decode bound ``ceil(W / bs) + 1``).
        """
        full = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return full
        c = max(1, min(chunk_size, num_tokens))
        return min(full, -(-(self.sliding_window - 1 + c) // block_size) + 1)


def make_kv_cache_groups(sliding_window: tuple[int | None, ...], hybrid: bool = True) -> list[KVCacheGroupSpec]:
    """Group layers by attention type (vLLM's hybrid allocator layout).

    Args:
        sliding_window: per layer, its window in tokens or None (``ModelConfig.sliding_window``).
        hybrid: False treats every layer as full attention in one group (the layers still
            mask by their windows; only the freeing is off), as vLLM's
            ``--disable-hybrid-kv-cache-manager``.
    Returns:
        Groups of ``g`` layers each, ``g`` = gcd of the per-type layer counts; the full group(s)
        first, then the sliding-window groups by window; layers in index order.
    Raises:
        ValueError: no layers.
    """
    if not sliding_window:
        raise ValueError("a model needs at least one layer to build KV cache groups")
    by_type: dict[int | None, list[int]] = {}
    for i, w in enumerate(sliding_window):
        by_type.setdefault(w if hybrid else None, []).append(i)
    if len(by_type) == 1:
        (w, layers), = by_type.items()
        return [KVCacheGroupSpec(_type_name(w), tuple(layers), w)]
    g = math.gcd(*(len(v) for v in by_type.values()))
    groups = []
    for w in sorted(by_type, key=lambda x: (x is not None, x or 0)):
        layers = by_type[w]
        n = len(layers) // g
        for k in range(n):
            name = _type_name(w) + (f".{k}" if n > 1 else "")
            groups.append(KVCacheGroupSpec(name, tuple(layers[k * g : (k + 1) * g]), w))
    return groups


def _type_name(window: int | None) -> str:
    return "full_attention" if window is None else f"sliding_window_{window}"


def layer_placement(groups: list[KVCacheGroupSpec]) -> tuple[int, dict[int, tuple[int, int]]]:
    """Where each layer's KV lives.

    Returns:
        ``(group_size, {layer_id: (group_index, tensor_index)})``: ``group_size`` cache tensors
        are allocated, and layer ``layer_ids[k]`` of group ``j`` reads and writes tensor ``k``
        through group ``j``'s block tables.
    """
    size = max(len(g.layer_ids) for g in groups)
    return size, {layer: (j, k) for j, g in enumerate(groups) for k, layer in enumerate(g.layer_ids)}
