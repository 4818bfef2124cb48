"""Prefix-cache lookups and caching of :class:`~llmd.daemon.kv.manager.KVCacheManager`.

A mixin: the state (``req_extra``, ``req_block_hashes``, ``num_cached_block``, the query/hit
counters) and its documentation are ``KVCacheManager``'s. Units: tokens for counts and
positions, ``block_size`` tokens per block; hashes are 32-byte chain hashes
(:mod:`llmd.daemon.kv.prefix_cache`).

vLLM v1 automatic prefix caching (`vllm/v1/core/kv_cache_manager.py`
``get_computed_blocks``, ``cache_blocks``; `single_type_kv_cache_manager.py`
``find_longest_cache_hit``): a new request starts from the longest run of cached full blocks
of its prompt (:meth:`PrefixCacheMixin.get_computed_blocks`), and a running request's full,
computed blocks are registered under their chain hashes (:meth:`PrefixCacheMixin.cache_blocks`).
:meth:`PrefixCacheMixin.uncomputed_block_hashes` and :meth:`PrefixCacheMixin.in_flight_run`
serve the scheduler's wait for a prefix that a running request is computing (SGLang's
in-batch prefix caching check).

Pure bookkeeping: nothing here touches tensors.
"""

from __future__ import annotations

from .block_pool import KVCacheBlock
from .prefix_cache import extend_block_hashes, extra_keys, find_longest_cache_hit


class PrefixCacheMixin:
    """:class:`~llmd.daemon.kv.manager.KVCacheManager`'s prefix-cache lookups and caching;
    reads and sets that class's attributes."""

    def _hashes(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[bytes]:
        extra = self.req_extra.setdefault(request_id, extra_keys(self.model_id, self.kv_cache_dtype, None))
        hashes = self.req_block_hashes.setdefault(request_id, [])
        return extend_block_hashes(hashes, token_ids, self.block_size, self.root_hash, extra, num_tokens)

    def get_computed_blocks(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                            cache_salt: str | None = None) -> tuple[int, list[list[KVCacheBlock | None]]]:
        """Longest cached prefix of a new request's prompt (tokens, per-group blocks).

        Only full blocks, and never the block of the last prompt token (it must be computed
        to sample): 31 prompt tokens -> 16 cached, 32 -> 16, 33 -> 32 for block size 16.
        Empty block lists when caching is off. Called when the request is admitted (never a
        stale count; :meth:`record_prefix_lookup` counts it); a request waiting at the head of
        the queue keeps its block hashes between attempts.
        """
        extra = extra_keys(self.model_id, self.kv_cache_dtype, cache_salt)
        if self.req_extra.get(request_id) != extra:
            self.req_extra[request_id] = extra
            self.req_block_hashes.pop(request_id, None)
        if not self.enable_caching:
            return 0, [[] for _ in self.groups]
        hashes = self._hashes(request_id, token_ids, num_prompt_tokens)
        eligible = (num_prompt_tokens - 1) // self.block_size
        bs = self.block_size

        def lookup(g: int, i: int) -> KVCacheBlock | None:
            return self.block_pool.get_cached_block(g, hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]))

        num_hit, blocks = find_longest_cache_hit(self.groups, eligible, bs, lookup)
        return num_hit, blocks

    def uncomputed_block_hashes(self, request_id: str, num_computed_tokens: int) -> list[bytes]:
        """Chain hashes of a running request's full blocks from position ``num_computed_tokens``
        on that :meth:`get_computed_blocks` hashed at its admission (its prompt's): blocks it
        is yet to compute and will then cache. Empty when caching is off."""
        if not self.enable_caching:
            return []
        return self.req_block_hashes.get(request_id, [])[num_computed_tokens // self.block_size :]

    def in_flight_run(self, request_id: str, num_prompt_tokens: int, num_cached_tokens: int,
                      in_flight: set[bytes]) -> int:
        """After :meth:`get_computed_blocks`: how many blocks in a row, from the first one a request
        would compute itself (the one after its ``num_cached_tokens`` hit), have their chain hash
        in ``in_flight`` (being computed by running requests), counting only blocks that could be
        hits (full, before the last prompt token's). 0 when caching is off."""
        if not self.enable_caching:
            return 0
        hashes = self.req_block_hashes.get(request_id, [])
        k, end = num_cached_tokens // self.block_size, min((num_prompt_tokens - 1) // self.block_size, len(hashes))
        n = 0
        while k + n < end and hashes[k + n] in in_flight:
            n += 1
        return n

    def record_prefix_lookup(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count one admitted request's lookup in the query/hit counters (tokens)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_prompt_tokens
            self.prefix_cache_hits += num_cached_tokens

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's full, computed blocks under their chain hashes."""
        if not self.enable_caching or request_id not in self.req_to_blocks or request_id in self.shifted:
            return
        n_full = num_computed_tokens // self.block_size
        hashes = self._hashes(request_id, token_ids, n_full * self.block_size)
        done = self.num_cached_block.setdefault(request_id, [0] * self.num_groups)
        bs = self.block_size
        for g, table in enumerate(self.req_to_blocks[request_id]):
            for i in range(done[g], min(n_full, len(table))):
                if not table[i].is_null:
                    self.block_pool.cache_full_block(table[i], g, hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]))
            done[g] = max(done[g], min(n_full, len(table)))

    def reset_prefix_cache(self) -> int:
        """Drop cached blocks that are free (in-use blocks stay); returns how many."""
        return self.block_pool.reset_prefix_cache()
