"""Per-request block tables on top of a :class:`BlockPool`.

A simplified vLLM v1 ``KVCacheManager`` (`vllm/v1/core/kv_cache_manager.py`, single
full-attention KV cache group, no prefix caching yet): each request owns a block table,
the ordered list of blocks holding its tokens' K/V, ``block_size`` tokens per block.
The scheduler asks :meth:`KVCacheManager.allocate_slots` to grow a table before each
step; allocation is all-or-nothing so a failed request can be preempted cleanly.

Pure bookkeeping: nothing here touches tensors.
"""

from __future__ import annotations

from collections import Counter

from .block_pool import BlockPool, KVCacheBlock


class KVCacheManager:
    """Maps request ids to block tables.

    Args:
        num_blocks: total KV cache blocks including the null block 0 (>= 2).
        block_size: tokens per block (>= 1).

    Raises ``ValueError`` for out-of-range arguments.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        # request_id -> block table (ordered blocks); vLLM's ``req_to_blocks``.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    # ---- queries -------------------------------------------------------------------
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
        """Ids of requests currently holding a block table, in insertion order."""
        return list(self.req_to_blocks)

    def get_block_table(self, request_id: str) -> list[int]:
        """Block ids of the request's table in token order; ``[]`` for an unknown id."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def get_num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks needed so the table covers ``num_tokens`` total tokens:
        ``max(0, ceil(num_tokens / block_size) - blocks held)``. ``ValueError`` if < 0."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - self.num_blocks_held(request_id))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.get_num_blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    # ---- mutation ------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover ``num_tokens`` total tokens (not new tokens).

        Returns the newly allocated block ids (``[]`` if already covered), or ``None``
        with nothing allocated when the pool has too few free blocks. A request with
        no table yet gets one (possibly empty when ``num_tokens`` is 0).
        """
        num_new = self.get_num_blocks_needed(request_id, num_tokens)
        if num_new > self.num_free_blocks:
            return None
        table = self.req_to_blocks.setdefault(request_id, [])
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, tail first (vLLM frees in reverse so a
        table's last blocks are evicted first later). Unknown ids are a no-op, so
        aborting an already finished request is safe."""
        table = self.req_to_blocks.pop(request_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    # ---- invariants ----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the bookkeeping is consistent; raises ``AssertionError`` naming the fault.

        Checks: free-queue links agree both ways and no block is queued twice; the null
        block is in no table and not queued; every block is either queued with
        ``ref_cnt`` 0 or has ``ref_cnt`` equal to the number of tables holding it;
        free + used == usable.
        """
        pool = self.block_pool
        queue = pool.free_block_queue
        queue.check_links()
        free = queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block appears twice in the free queue"
        assert pool.null_block.block_id not in free_ids, "null block is in the free queue"
        holders: Counter[int] = Counter()
        for rid, table in self.req_to_blocks.items():
            for b in table:
                assert not b.is_null, f"null block in block table of {rid!r}"
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
