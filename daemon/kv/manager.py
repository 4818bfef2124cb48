"""Per-request block tables, one per KV cache group, on top of a shared :class:`BlockPool`.

A simplified vLLM v1 ``KVCacheManager`` with its hybrid allocator
(`vllm/v1/core/kv_cache_manager.py`, `single_type_kv_cache_manager.py`): each request owns
one block table per KV cache group (:mod:`llmd.daemon.kv.groups`), the ordered list of
blocks holding that group's K/V for its tokens, ``block_size`` tokens per block. Full
attention groups keep every block; sliding-window groups replace blocks that fell out of the
window with the null block (:meth:`KVCacheManager.remove_skipped_blocks`). Allocation is
all-or-nothing across groups so a failed request can be preempted cleanly.

Pure bookkeeping: nothing here touches tensors.
"""

from __future__ import annotations

from collections import Counter

from .block_pool import BlockPool, KVCacheBlock
from .groups import KVCacheGroupSpec


class KVCacheManager:
    """Maps request ids to per-group block tables.

    Args:
        num_blocks: total KV cache blocks including the null block 0 (>= 2).
        block_size: tokens per block (>= 1).
        groups: the KV cache groups; default one full-attention group.

    Raises ``ValueError`` for out-of-range arguments.
    """

    def __init__(self, num_blocks: int, block_size: int, groups: list[KVCacheGroupSpec] | None = None) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.groups = list(groups) if groups else [KVCacheGroupSpec("full_attention", ())]
        # request_id -> one block table (ordered blocks) per group; vLLM's ``req_to_blocks``.
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}

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
        (vLLM ``SlidingWindowManager.remove_skipped_blocks``). Returns blocks freed.
        """
        tables = self.req_to_blocks.get(request_id)
        if not tables:
            return 0
        freed: list[KVCacheBlock] = []
        for spec, table in zip(self.groups, tables):
            if spec.sliding_window is None:
                continue
            num_skipped = max(0, num_computed_tokens - spec.sliding_window + 1) // self.block_size
            for i in range(min(num_skipped, len(table)) - 1, -1, -1):
                if table[i].is_null:
                    break  # everything before was dropped earlier
                freed.append(table[i])
                table[i] = self.block_pool.null_block
        if freed:
            self.block_pool.free_blocks(freed)
        return len(freed)

    def allocate_slots(self, request_id: str, num_tokens: int, num_computed_tokens: int | None = None) -> list[int] | None:
        """Grow every table to cover ``num_tokens`` total tokens (not new tokens).

        When ``num_computed_tokens`` is given, sliding-window blocks out of reach of its
        queries are freed first. Returns the newly allocated block ids (all groups, group
        order; ``[]`` if already covered), or ``None`` with nothing allocated when the pool
        has too few free blocks. A request with no tables yet gets them (possibly empty).
        """
        if num_computed_tokens is not None:
            self.remove_skipped_blocks(request_id, num_computed_tokens)
        num_new = self.get_num_blocks_needed(request_id, num_tokens)
        if num_new > self.num_free_blocks:
            return None
        tables = self.req_to_blocks.setdefault(request_id, [[] for _ in self.groups])
        needed = -(-num_tokens // self.block_size)
        new_ids: list[int] = []
        for table in tables:
            n = max(0, needed - len(table))
            blocks = self.block_pool.get_new_blocks(n)
            table.extend(blocks)
            new_ids.extend(b.block_id for b in blocks)
        return new_ids

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, each table tail first (vLLM frees in reverse
        so a table's last blocks are evicted first later). Unknown ids are a no-op, so
        aborting an already finished request is safe."""
        tables = self.req_to_blocks.pop(request_id, None)
        for table in tables or ():
            self.block_pool.free_blocks(reversed(table))

    # ---- invariants ----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the bookkeeping is consistent; raises ``AssertionError`` naming the fault.

        Checks: free-queue links agree both ways and no block is queued twice; the null
        block is not queued and appears only in sliding-window tables, before every real
        block; every block is either queued with ``ref_cnt`` 0 or has ``ref_cnt`` equal to
        the number of tables holding it; free + used == usable.
        """
        pool = self.block_pool
        queue = pool.free_block_queue
        queue.check_links()
        free = queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block appears twice in the free queue"
        assert pool.null_block.block_id not in free_ids, "null block is in the free queue"
        holders: Counter[int] = Counter()
        for rid, tables in self.req_to_blocks.items():
            assert len(tables) == self.num_groups, f"{rid!r} has {len(tables)} tables for {self.num_groups} groups"
            for spec, table in zip(self.groups, tables):
                seen_real = False
                for b in table:
                    if b.is_null:
                        assert spec.sliding_window is not None, f"null block in full-attention table of {rid!r}"
                        assert not seen_real, f"null block after a real block in {spec.name} table of {rid!r}"
                        continue
                    seen_real = True
                    assert pool.blocks[b.block_id] is b, f"foreign block {b.block_id} in table of {rid!r}"
                    holders[b.block_id] += 1
        for b in pool.blocks[1:]:
            if b.block_id in free_ids:
                assert b.ref_cnt == 0, f"free block {b.block_id} has ref_cnt {b.ref_cnt}"
                assert holders[b.block_id] == 0, f"free block {b.block_id} is in a block table"
            else:
                assert b.ref_cnt > 0, f"block {b.block_id} is neither free nor referenced"
                assert b.ref_cnt == holders[b.block_id], (
                    f"block {b.block_id} has ref_cnt {b.ref_cnt} but is in {holders[b.block_id]} tables"
                )
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert len(free) + used == pool.num_usable_blocks, (
            f"free ({len(free)}) + used ({used}) != usable ({pool.num_usable_blocks})"
        )
        assert self.num_used_blocks == used, f"num_used_blocks {self.num_used_blocks} != {used}"
