"""Per-request block tables, one per KV cache group, on top of a shared :class:`BlockPool`.

A simplified vLLM v1 ``KVCacheManager`` with its hybrid allocator
(`vllm/v1/core/kv_cache_manager.py`, `single_type_kv_cache_manager.py`): each request owns
one block table per KV cache group (:mod:`llmd.daemon.kv.groups`), the ordered list of
blocks holding that group's K/V for its tokens, ``block_size`` tokens per block. Full
attention groups keep every block; sliding-window groups replace blocks that fell out of the
window with the null block (:meth:`KVCacheManager.remove_skipped_blocks`). Allocation is
all-or-nothing across groups so a failed request can be preempted cleanly.

With prefix caching on, full blocks are registered under their chain hash once computed
(:meth:`cache_blocks`) and a new request starts from the longest cached prefix
(:meth:`get_computed_blocks`, :mod:`llmd.daemon.kv.prefix_cache`). Shared blocks are
reference counted; a shared, partly filled block is copied on write before a request
appends to it (parallel sampling), the copies being queued in :attr:`pending_copies` for
the runner.

int4 KV caches (KIVI) keep each sequence's open block's K in a 16-bit *residual*: with
``num_residual_slots`` > 0 every request holding tables holds one residual slot per group
(:attr:`req_residual`), taken when its tables are created (allocation fails, allocating nothing,
when no slot is free), copied for a fork (:attr:`pending_residual_copies`, for the runner) and
released with its blocks (:meth:`free`: finish, abort, preemption).

Pure bookkeeping: nothing here touches tensors.
"""

from __future__ import annotations

from .block_pool import BlockPool, KVCacheBlock
from .groups import KVCacheGroupSpec
from .integrity import check_integrity
from .prefix_cache import extend_block_hashes, extra_keys, find_longest_cache_hit, make_root_hash


class KVCacheManager:
    """Maps request ids to per-group block tables.

    Args:
        num_blocks: total KV cache blocks including the null block 0 (>= 2).
        block_size: tokens per block (>= 1).
        groups: the KV cache groups; default one full-attention group.
        enable_caching: prefix caching on.
        prefix_cache_seed: seed of the chain root hash (None: random per manager).
        model_id, kv_cache_dtype: extra keys of every block hash.
        num_residual_slots: int4 residual slots (0: the format has none).

    Raises ``ValueError`` for out-of-range arguments.
    """

    def __init__(self, num_blocks: int, block_size: int, groups: list[KVCacheGroupSpec] | None = None,
                 enable_caching: bool = False, prefix_cache_seed: int | None = None, model_id: str = "",
                 kv_cache_dtype: str = "auto", num_residual_slots: int = 0) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.groups = list(groups) if groups else [KVCacheGroupSpec("full_attention", ())]
        # request_id -> one block table (ordered blocks) per group; vLLM's ``req_to_blocks``.
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        self.enable_caching = enable_caching
        self.root_hash = make_root_hash(prefix_cache_seed)
        self.model_id, self.kv_cache_dtype = model_id, kv_cache_dtype
        self.req_extra: dict[str, bytes] = {}  # request_id -> extra keys of its block hashes
        self.req_block_hashes: dict[str, list[bytes]] = {}
        self.num_cached_block: dict[str, list[int]] = {}  # per group: blocks already registered
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the runner
        # context shift (:mod:`.shift`): blocks a sliding-window table keeps at its head, and the
        # requests whose later blocks hold shifted K (never registered in the prefix cache)
        self.req_keep_blocks: dict[str, int] = {}
        self.shifted: set[str] = set()
        self.num_residual_slots = num_residual_slots
        self.free_residual_slots: list[int] = list(range(num_residual_slots - 1, -1, -1))  # popped from the end
        self.req_residual: dict[str, list[int]] = {}  # request_id -> its residual slot per group
        self.pending_residual_copies: list[tuple[int, int]] = []  # fork: (src slot, dst slot) for the runner
        self.prefix_cache_queries = 0  # prompt tokens looked up (tokens)
        self.prefix_cache_hits = 0  # of which served from the cache (tokens)

    # ---- queries -------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_usable_blocks(self) -> int:
        """``num_blocks - 1`` (block 0 is the null block)."""
        return self.block_pool.num_usable_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return self.block_pool.get_usage()

    def request_ids(self) -> list[str]:
        """Ids of requests currently holding block tables, in insertion order."""
        return list(self.req_to_blocks)

    def get_block_table(self, request_id: str, group: int = 0) -> list[int]:
        """Block ids of the request's table in ``group`` in token order (0 = null block for
        positions a sliding window dropped); ``[]`` for an unknown id."""
        tables = self.req_to_blocks.get(request_id)
        return [b.block_id for b in tables[group]] if tables else []

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """One block-id list per group (see :meth:`get_block_table`)."""
        return [self.get_block_table(request_id, g) for g in range(self.num_groups)]

    def num_blocks_held(self, request_id: str, group: int | None = None) -> int:
        """Real (non-null) blocks the request holds, in one group or all of them."""
        tables = self.req_to_blocks.get(request_id)
        if not tables:
            return 0
        sel = tables if group is None else [tables[group]]
        return sum(1 for t in sel for b in t if not b.is_null)

    def num_used_blocks_per_group(self) -> list[int]:
        """Distinct blocks in use per group (blocks a group's tables hold)."""
        seen: list[set[int]] = [set() for _ in self.groups]
        for tables in self.req_to_blocks.values():
            for g, t in enumerate(tables):
                seen[g].update(b.block_id for b in t if not b.is_null)
        return [len(s) for s in seen]

    def get_num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks needed, over all groups, so every table covers ``num_tokens`` total
        tokens: per group ``max(0, ceil(num_tokens / block_size) - len(table))`` (null
        entries count as covered). ``ValueError`` if ``num_tokens`` < 0."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        needed = -(-num_tokens // self.block_size)
        tables = self.req_to_blocks.get(request_id)
        held = [len(t) for t in tables] if tables else [0] * self.num_groups
        return sum(max(0, needed - h) for h in held)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.get_num_blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    # ---- mutation ------------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Free sliding-window blocks no query at position >= ``num_computed_tokens`` can see.

        With window ``W`` the first query of the next step sees keys from
        ``num_computed_tokens - W + 1``; blocks that end before it become the null block
        (vLLM ``SlidingWindowManager.remove_skipped_blocks``), except the first
        :attr:`req_keep_blocks` of a request that may context-shift. Returns blocks freed.
        """
        tables = self.req_to_blocks.get(request_id)
        if not tables:
            return 0
        freed: list[KVCacheBlock] = []
        keep = self.req_keep_blocks.get(request_id, 0)
        for spec, table in zip(self.groups, tables):
            if spec.sliding_window is None:
                continue
            num_skipped = max(0, num_computed_tokens - spec.sliding_window + 1) // self.block_size
            for i in range(min(num_skipped, len(table)) - 1, keep - 1, -1):
                if table[i].is_null:
                    break  # everything before was dropped earlier
                freed.append(table[i])
                table[i] = self.block_pool.null_block
        if freed:
            self.block_pool.free_blocks(freed)
        return len(freed)

    def allocate_slots(self, request_id: str, num_tokens: int, num_computed_tokens: int | None = None,
                       new_computed_blocks: list[list[KVCacheBlock | None]] | None = None) -> list[int] | None:
        """Grow every table to cover ``num_tokens`` total tokens (not new tokens).

        ``new_computed_blocks`` (from :meth:`get_computed_blocks`, for a request without
        tables yet) start the tables with cache hits, sharing them by reference count. When
        ``num_computed_tokens`` is given, sliding-window blocks out of reach of its queries
        are freed first, and a shared partly filled block at that position is copied on write
        (queued in :attr:`pending_copies`). Returns the newly allocated block ids (all groups,
        group order; ``[]`` if already covered), or ``None`` with nothing allocated when the
        pool has too few free blocks.
        """
        if num_computed_tokens is not None:
            self.remove_skipped_blocks(request_id, num_computed_tokens)
        bs = self.block_size
        num_new = self.get_num_blocks_needed(request_id, num_tokens)
        touched_free = 0
        if new_computed_blocks is not None:
            assert request_id not in self.req_to_blocks, "cache hits are only for a new request"
            hit = max(len(t) for t in new_computed_blocks)
            num_new -= sum(min(hit, -(-num_tokens // bs)) for _ in self.groups)
            touched_free = len({b.block_id for t in new_computed_blocks for b in t if b is not None and b.ref_cnt == 0})
        cow = self._cow_positions(request_id, num_computed_tokens)
        if num_new + touched_free + len(cow) > self.num_free_blocks:
            return None
        if not self.take_residual(request_id):
            return None
        if new_computed_blocks is not None:
            tables = [[b if b is not None else self.block_pool.null_block for b in t] for t in new_computed_blocks]
            for t in tables:
                self.block_pool.touch(t)
            self.req_to_blocks[request_id] = tables
        tables = self.req_to_blocks.setdefault(request_id, [[] for _ in self.groups])
        new_ids: list[int] = []
        for g, i in cow:
            old = tables[g][i]
            [new] = self.block_pool.get_new_blocks(1)
            tables[g][i] = new
            self.block_pool.free_blocks([old])
            self.pending_copies.append((old.block_id, new.block_id))
            new_ids.append(new.block_id)
        needed = -(-num_tokens // bs)
        for table in tables:
            blocks = self.block_pool.get_new_blocks(max(0, needed - len(table)))
            table.extend(blocks)
            new_ids.extend(b.block_id for b in blocks)
        return new_ids

    def take_residual(self, request_id: str) -> bool:
        """Give a request its residual slots (one per group) if it needs them and has none;
        False (nothing taken) when too few are free."""
        if not self.num_residual_slots or request_id in self.req_residual:
            return True
        if len(self.free_residual_slots) < self.num_groups:
            return False
        self.req_residual[request_id] = [self.free_residual_slots.pop() for _ in self.groups]
        return True

    def residual_slots(self, request_id: str) -> list[int] | None:
        """The request's residual slot per group (int4 caches), or None."""
        return self.req_residual.get(request_id)

    def take_pending_residual_copies(self) -> list[tuple[int, int]]:
        """Residual (src slot, dst slot) copies queued by forks since the last call."""
        out, self.pending_residual_copies = self.pending_residual_copies, []
        return out

    def _cow_positions(self, request_id: str, num_computed_tokens: int | None) -> list[tuple[int, int]]:
        """(group, table index) of shared partly filled blocks the next token would write into."""
        tables = self.req_to_blocks.get(request_id)
        if not tables or not num_computed_tokens or num_computed_tokens % self.block_size == 0:
            return []
        i = num_computed_tokens // self.block_size
        return [(g, i) for g, t in enumerate(tables) if i < len(t) and t[i].ref_cnt > 1]

    def fork(self, parent_id: str, child_id: str, share: bool = True, residual: bool = True) -> None:
        """Give ``child_id`` the parent's block tables, sharing every block (ref count +1);
        the first append into a shared partial block copies it (parallel sampling, beams).

        ``share=False`` (the beam benchmark's baseline without sharing) gives the child fresh
        blocks instead, each queued in :attr:`pending_copies` from the parent's. Raises
        ``ValueError`` if the child has tables already, ``RuntimeError`` if the pool cannot
        hold the copies (nothing allocated then). With int4 residual slots the child gets its own,
        a copy of the parent's (``residual=False``: none, for a pin that only keeps full blocks;
        ``RuntimeError`` when none is free)."""
        if child_id in self.req_to_blocks:
            raise ValueError(f"request {child_id!r} already has block tables")
        parent_res = self.req_residual.get(parent_id) if residual else None
        if parent_res is not None and len(self.free_residual_slots) < self.num_groups:
            raise RuntimeError(f"no free int4 residual slot for {child_id!r}")
        tables = [list(t) for t in self.req_to_blocks[parent_id]]
        if not share:
            real = [(g, i) for g, t in enumerate(tables) for i, b in enumerate(t) if not b.is_null]
            if len(real) > self.num_free_blocks:
                raise RuntimeError(f"copying {len(real)} blocks for {child_id!r}: only {self.num_free_blocks} free")
            for (g, i), new in zip(real, self.block_pool.get_new_blocks(len(real))):
                self.pending_copies.append((tables[g][i].block_id, new.block_id))
                tables[g][i] = new
        else:
            for t in tables:
                self.block_pool.touch(t)
        if parent_res is not None:
            self.take_residual(child_id)
            self.pending_residual_copies.extend(zip(parent_res, self.req_residual[child_id]))
        self.req_to_blocks[child_id] = tables
        if parent_id in self.shifted:
            self.shifted.add(child_id)
        for d in (self.req_extra, self.req_block_hashes, self.num_cached_block, self.req_keep_blocks):
            if parent_id in d:
                d[child_id] = list(d[parent_id]) if isinstance(d[parent_id], list) else d[parent_id]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs queued since the last call (the runner copies
        each block's K/V and scales in every cache tensor before the step's forward)."""
        out, self.pending_copies = self.pending_copies, []
        return out

    # ---- prefix caching ------------------------------------------------------------
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

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, each table tail first (vLLM frees in reverse
        so a table's last blocks are evicted first later). Unknown ids are a no-op, so
        aborting an already finished request is safe."""
        tables = self.req_to_blocks.pop(request_id, None)
        for d in (self.req_extra, self.req_block_hashes, self.num_cached_block):
            d.pop(request_id, None)
        self.shifted.discard(request_id)
        self.req_keep_blocks.pop(request_id, None)
        self.free_residual_slots.extend(reversed(self.req_residual.pop(request_id, ())))
        for table in tables or ():
            self.block_pool.free_blocks(reversed(table))

    # ---- invariants ----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the bookkeeping is consistent (:func:`llmd.daemon.kv.integrity.check_integrity`);
        raises ``AssertionError`` naming the fault."""
        check_integrity(self)
