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

The class is split by responsibility: allocation, queries and release here; prefix-cache
lookups and caching in :mod:`llmd.daemon.kv.manager_prefix` (:class:`PrefixCacheMixin`);
forks, the copy-on-write queue and residual slots in :mod:`llmd.daemon.kv.manager_fork`
(:class:`ForkMixin`).

Pure bookkeeping: nothing here touches tensors.
"""

from __future__ import annotations

from .block_pool import BlockPool, KVCacheBlock
from .groups import KVCacheGroupSpec
from .integrity import check_integrity
from .manager_fork import ForkMixin
from .manager_prefix import PrefixCacheMixin
from .prefix_cache import make_root_hash


class KVCacheManager(PrefixCacheMixin, ForkMixin):
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
