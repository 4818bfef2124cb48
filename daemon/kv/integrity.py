"""KV manager invariants, checked after every step by tests (and on demand by benches).

Kept apart from :mod:`llmd.daemon.kv.manager` so the bookkeeping and its audit stay small.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manager import KVCacheManager


def check_integrity(manager: "KVCacheManager") -> None:
    """Assert the bookkeeping is consistent; raises ``AssertionError`` naming the fault.

    Checks: free-queue links agree both ways and no block is queued twice; the null
    block is not queued and appears only in sliding-window tables, before every real
    block (after a context-shift request's kept head blocks); every block is either queued with
    ``ref_cnt`` 0 or has ``ref_cnt`` equal to
    the number of tables holding it; free + used == usable; int4 residual slots: each
    request holding tables holds one per group (a pin may hold none), no slot is held twice or
    both held and free, and held + free == the pool's slots.
    """
    pool = manager.block_pool
    queue = pool.free_block_queue
    queue.check_links()
    free = queue.get_all_free_blocks()
    free_ids = {b.block_id for b in free}
    assert len(free_ids) == len(free), "a block appears twice in the free queue"
    assert pool.null_block.block_id not in free_ids, "null block is in the free queue"
    holders: Counter[int] = Counter()
    for rid, tables in manager.req_to_blocks.items():
        assert len(tables) == manager.num_groups, f"{rid!r} has {len(tables)} tables for {manager.num_groups} groups"
        keep = manager.req_keep_blocks.get(rid, 0)  # a context-shift request's head blocks stay
        for spec, table in zip(manager.groups, tables):
            seen_real = False
            for i, b in enumerate(table):
                if b.is_null:
                    assert spec.sliding_window is not None, f"null block in full-attention table of {rid!r}"
                    assert not seen_real, f"null block after a real block in {spec.name} table of {rid!r}"
                    continue
                seen_real = seen_real or i >= keep
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
    for (g, h), b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h and b.group == g and b.token_ids is not None, \
            f"cache map entry of block {b.block_id} is stale"
    hashed = sum(1 for b in pool.blocks if b.block_hash is not None)
    assert hashed == len(pool.cached_block_hash_to_block), "a hashed block is missing from the cache map"
    cached_free = sum(1 for b in pool.cached_block_hash_to_block.values() if b.ref_cnt == 0)
    assert pool.num_cached_free_blocks == cached_free, (
        f"num_cached_free_blocks {pool.num_cached_free_blocks} != {cached_free} free blocks with a hash")
    used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert len(free) + used == pool.num_usable_blocks, (
        f"free ({len(free)}) + used ({used}) != usable ({pool.num_usable_blocks})"
    )
    assert manager.num_used_blocks == used, f"num_used_blocks {manager.num_used_blocks} != {used}"
    _check_residual(manager)


def _check_residual(manager: "KVCacheManager") -> None:
    n = manager.num_residual_slots
    if not n:
        assert not manager.req_residual, "residual slots held without a residual pool"
        return
    held = [s for slots in manager.req_residual.values() for s in slots]
    free = manager.free_residual_slots
    assert len(set(held)) == len(held), "a residual slot is held twice"
    assert not set(held) & set(free), "a residual slot is both held and free"
    assert len(held) + len(free) == n and set(held) | set(free) == set(range(n)), (
        f"residual slots: held ({len(held)}) + free ({len(free)}) != {n}")
    for rid, slots in manager.req_residual.items():
        assert rid in manager.req_to_blocks, f"{rid!r} holds residual slots but no block tables"
        assert len(slots) == manager.num_groups, f"{rid!r} holds {len(slots)} residual slots"
