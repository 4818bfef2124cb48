"""Prefix caching: block-chain hashes and the longest cache hit over KV cache groups.

Follows vLLM v1 automatic prefix caching (`vllm/v1/core/kv_cache_utils.py`
``hash_block_tokens``, `single_type_kv_cache_manager.py` ``find_longest_cache_hit``): the
hash of full block ``i`` is ``H(hash of block i-1, its token ids, extra keys)``, rooted in a
per-daemon random seed, so equal hashes mean equal token prefixes (and equal extra keys)
with overwhelming probability; the pool still compares token ids on every hit. H is
SHA-256 over a length-prefixed encoding (no ambiguity between fields).

Extra keys are everything besides the tokens that changes the KV: model identity, KV cache
dtype, and the request's optional ``cache_salt``.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence

from .block_pool import KVCacheBlock
from .groups import KVCacheGroupSpec


def make_root_hash(seed: int | None = None) -> bytes:
    """Root of every chain: ``sha256(seed)`` for a given seed (tests), else 32 random bytes."""
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(b"llmd-prefix-cache-seed:" + str(seed).encode()).digest()


def extra_keys(model_id: str, kv_cache_dtype: str, cache_salt: str | None) -> bytes:
    """Encode the extra keys of a request's blocks (length-prefixed UTF-8 fields)."""
    out = b""
    for f in (model_id, kv_cache_dtype, cache_salt or ""):
        data = f.encode("utf-8", "surrogatepass")
        out += struct.pack("<I", len(data)) + data
    return out + (b"\x01" if cache_salt is not None else b"\x00")


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra: bytes) -> bytes:
    """SHA-256 of (parent hash, token ids as int64, extra keys); 32 bytes."""
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(extra)
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, root: bytes, extra: bytes,
                        num_tokens: int) -> list[bytes]:
    """Append hashes so ``hashes`` covers every full block of ``token_ids[:num_tokens]``; returns it."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes


def find_longest_cache_hit(
    groups: list[KVCacheGroupSpec], num_blocks: int, block_size: int,
    lookup: Callable[[int, int], KVCacheBlock | None],
) -> tuple[int, list[list[KVCacheBlock | None]]]:
    """Largest block-aligned ``L`` (tokens) whose KV every group can serve from the cache.

    A full-attention group needs cached blocks for all of ``[0, L)``; a sliding-window group
    with window ``W`` only those covering ``[L - W, L)``. Starting from the full groups' hit,
    each sliding group lowers ``L`` to its own largest valid value until nothing changes
    (a fixed point; vLLM's hybrid ``find_longest_cache_hit``).

    Args:
        num_blocks: full blocks eligible for a hit (never the one holding the last prompt token).
        lookup: ``(group, block index) -> cached block or None``.
    Returns:
        ``(L, per group the blocks for [0, L))`` with None where a sliding group needs no block.
    """
    hits = [[lookup(g, i) for i in range(num_blocks)] for g in range(len(groups))]
    limit = num_blocks
    for g, spec in enumerate(groups):
        if spec.sliding_window is None:
            n = next((i for i, b in enumerate(hits[g]) if b is None), num_blocks)
            limit = min(limit, n)
    while True:
        new = limit
        for g, spec in enumerate(groups):
            if spec.sliding_window is not None:
                new = min(new, _sliding_hit(hits[g], new, spec.sliding_window, block_size))
        if new == limit:
            break
        limit = new
    out: list[list[KVCacheBlock | None]] = []
    for g, spec in enumerate(groups):
        first = 0 if spec.sliding_window is None else max(0, limit * block_size - spec.sliding_window) // block_size
        out.append([None] * first + hits[g][first:limit])
    return limit * block_size, out


def _sliding_hit(hits: list[KVCacheBlock | None], limit: int, window: int, block_size: int) -> int:
    """Largest ``n <= limit`` (blocks) with cached blocks covering tokens ``[n*bs - W, n*bs)``."""
    for n in range(limit, 0, -1):
        first = max(0, n * block_size - window) // block_size
        if all(b is not None for b in hits[first:n]):
            return n
    return 0
