"""Block-table side of a context shift (llama.cpp ``--context-shift`` on a paged cache).

A shift keeps a request's first ``keep_blocks`` blocks, drops the ``num_discard`` blocks after
them and moves every later block ``num_discard · block_size`` positions back::

    before  [ keep | discard | moved ............ ]      positions 0 .. n
    after   [ keep | moved ............ ]                positions 0 .. n − Δ

Per KV cache group, the discarded blocks are released (a sliding-window group may already hold
null blocks there) and each real moved block gets its keys re-rotated
(:func:`llmd.kernels.kv_shift.shift_keys`, queued here as ``(src, dst, group)`` for the
runner). A moved block is rotated **in place** only when this request alone holds it and it is
not in the prefix cache; a shared block (parallel-sampling siblings, prefix-cache hits) or a
cached one is rotated into a fresh block instead, so other holders and the cache keep the
unshifted K under its original hash. The request's later blocks are never registered in the
prefix cache (their K/V came from a context the tokens no longer show): :attr:`shifted`.

Sliding-window groups: their keep blocks stay allocated for a request that may shift
(:attr:`KVCacheManager.req_keep_blocks`, set at admission) because after a shift the window
of the new positions can reach back into the kept tokens.

Pure bookkeeping: nothing here touches tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manager import KVCacheManager


def can_shift_in_place(manager: "KVCacheManager", request_id: str, keep_blocks: int, num_discard: int) -> bool:
    """Whether :func:`shift_blocks` can run now: every table is long enough, the sliding-window
    groups still hold their keep blocks, and the pool has a fresh block for every shared moved
    block (cached exclusive ones can be evicted and rotated in place instead)."""
    tables = manager.req_to_blocks.get(request_id)
    if not tables:
        return False
    need = 0
    for table in tables:
        if len(table) < keep_blocks + num_discard + 1 or any(b.is_null for b in table[:keep_blocks]):
            return False
        need += sum(1 for b in table[keep_blocks + num_discard:] if not b.is_null and b.ref_cnt > 1)
    return need <= manager.num_free_blocks


def shift_blocks(manager: "KVCacheManager", request_id: str, keep_blocks: int,
                 num_discard: int) -> list[tuple[int, int, int]]:
    """Drop blocks ``[keep_blocks, keep_blocks + num_discard)`` of every table of the request
    and move the rest up; returns the ``(src, dst, group)`` key re-rotations the runner must
    apply (``dst == src`` in place).

    Raises ``ValueError`` (changing nothing) when :func:`can_shift_in_place` is False.
    """
    if not can_shift_in_place(manager, request_id, keep_blocks, num_discard):
        raise ValueError(f"cannot shift {request_id!r} by {num_discard} blocks after {keep_blocks} in place")
    pool = manager.block_pool
    tables = manager.req_to_blocks[request_id]
    lo, hi = keep_blocks, keep_blocks + num_discard
    for table in tables:  # release the discarded blocks first: they can take the copies
        pool.free_blocks(reversed(table[lo:hi]))
        del table[lo:hi]
    ops: list[tuple[int, int, int]] = []
    moved = [(g, i) for g, t in enumerate(tables) for i in range(lo, len(t)) if not t[i].is_null]
    shared = sum(1 for g, i in moved if tables[g][i].ref_cnt > 1)
    budget = manager.num_free_blocks - shared  # fresh blocks left for cached exclusive ones
    released = []  # freed only after every fresh block is taken, so none comes back as one
    for g, i in moved:
        b = tables[g][i]
        if b.ref_cnt == 1 and b.block_hash is not None:
            if budget > 0:
                budget -= 1
            else:
                pool.uncache_block(b)  # no room to keep the cached copy: rotate it in place
        if b.ref_cnt > 1 or b.block_hash is not None:
            [new] = pool.get_new_blocks(1)
            released.append(b)
            tables[g][i] = new
            ops.append((b.block_id, new.block_id, g))
        else:
            ops.append((b.block_id, b.block_id, g))
    pool.free_blocks(released)
    manager.shifted.add(request_id)
    hashes = manager.req_block_hashes.get(request_id)
    if hashes is not None:
        del hashes[lo:]
    done = manager.num_cached_block.get(request_id)
    if done is not None:
        manager.num_cached_block[request_id] = [min(d, lo) for d in done]
    return ops
