"""KV cache blocks, the LRU free block queue and the block pool.

Follows vLLM v1 (`vllm/v1/core/block_pool.py` and `vllm/v1/core/kv_cache_utils.py`):
the paged KV cache is split into ``num_blocks`` fixed-size blocks (``block_size`` tokens
each, the size being the manager's business). Block 0 is the reserved **null block**:
it is never handed out, and sliding-window layers later place it in block tables for
positions whose K/V have been dropped. Free blocks live in a doubly linked list in LRU
order (the head is evicted first), so taking, returning and touching a block are O(1).

Prefix caching (vLLM v1 automatic prefix caching): a full block may carry the hash of its
block chain; the pool maps ``(group, block hash)`` to that block. A freed hashed block keeps
its hash and stays findable until it is evicted, which happens only when
:meth:`BlockPool.get_new_blocks` takes it from the queue's head; unhashed blocks are put at
the head when freed, so they go before any cached block.

Pure bookkeeping: nothing here touches tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one KV cache block (vLLM's ``KVCacheBlock``).

    Attributes:
        block_id: index into the physical KV cache tensors, 0..num_blocks-1.
        ref_cnt: number of block tables (requests) holding this block; 0 means free.
        block_hash: hash of the full block's chain (prefix caching), None when not cached.
        token_ids: the block's tokens while it is cached (compared on every hit, so a hash
            collision can never serve wrong KV).
        group: KV cache group whose layers' K/V the cached block holds.
        prev_free_block / next_free_block: links of the free block queue (the queue uses
            sentinel nodes, so both are set while queued and both ``None`` otherwise).
        is_null: True only for the reserved null block 0.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    group: int = 0
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in LRU order (vLLM ``kv_cache_utils.py``).

    The head is the least recently freed block and is handed out first; freed blocks go
    to the tail. Uses sentinel head/tail nodes (block_id -1) so every operation is O(1)
    without branches on emptiness. ``remove`` takes a block out of the middle when a
    free block is touched again (prefix-cache hit).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(list(blocks))

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block; ``ValueError`` if empty."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head; ``ValueError`` (nothing popped) if fewer free."""
        if n > self.num_free_blocks:
            raise ValueError(f"requested {n} blocks but only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue in O(1); ``ValueError`` if absent."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free block queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (most recently freed); ``ValueError`` if already in."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free block queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (evicted first); ``ValueError`` if already in."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free block queue")
        first = self._head.next_free_block
        assert first is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        block.next_free_block = first
        first.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` to the tail in the order given."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to be evicted) first. O(n); for tests/dashboards."""
        out: list[KVCacheBlock] = []
        node = self._head.next_free_block
        while node is not None and node is not self._tail:
            out.append(node)
            node = node.next_free_block
        return out

    def check_links(self) -> None:
        """Assert forward/backward links agree and the count matches (``AssertionError``)."""
        fwd: list[KVCacheBlock] = []
        seen: set[int] = set()
        node = self._head
        while node is not self._tail:
            nxt = node.next_free_block
            assert nxt is not None, f"free queue broken after block {node.block_id}"
            assert nxt.prev_free_block is node, (
                f"free queue link mismatch: {node.block_id}.next={nxt.block_id} "
                f"but {nxt.block_id}.prev={getattr(nxt.prev_free_block, 'block_id', None)}"
            )
            if nxt is not self._tail:
                assert id(nxt) not in seen, f"block {nxt.block_id} twice in the free queue"
                seen.add(id(nxt))
                fwd.append(nxt)
            node = nxt
        assert len(fwd) == self.num_free_blocks, (
            f"free queue holds {len(fwd)} blocks but num_free_blocks={self.num_free_blocks}"
        )


class BlockPool:
    """Owns every :class:`KVCacheBlock` and the free block queue (vLLM ``BlockPool``).

    Args:
        num_blocks: total blocks in the KV cache, including the null block 0; >= 2,
            else ``ValueError``.

    Blocks 1..num_blocks-1 are usable and start free in id order. A block handed out by
    :meth:`get_new_blocks` has ``ref_cnt`` 1; :meth:`touch` shares it (+1) and
    :meth:`free_blocks` releases it (-1), returning it to the queue's tail at 0.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is the null block), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # (group, block hash) -> the cached block (in use or free); vLLM's cached_block_hash_to_block
        self.cached_block_hash_to_block: dict[tuple[int, bytes], KVCacheBlock] = {}
        self.num_evictions = 0
        self._num_cached_free = 0  # free blocks with a hash, kept as they change (num_cached_free_blocks)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out: ``num_blocks - 1``."""
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the LRU head, each with ``ref_cnt`` 1.

        Raises ``ValueError`` (taking nothing) if fewer are free or ``num_blocks < 0``.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0 and not block.is_null, block
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        del self.cached_block_hash_to_block[(block.group, block.block_hash)]
        block.block_hash = block.token_ids = None
        self.num_evictions += 1
        self._num_cached_free -= 1  # only free blocks are evicted

    def get_cached_block(self, group: int, block_hash: bytes, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        """The cached block of ``group`` with this hash and exactly these tokens, or None."""
        block = self.cached_block_hash_to_block.get((group, block_hash))
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache_full_block(self, block: KVCacheBlock, group: int, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Register a full, in-use block under ``(group, block_hash)``. Returns False (and
        changes nothing) when the block is already cached or another block holds the hash."""
        key = (group, block_hash)
        if block.block_hash is not None or block.is_null or key in self.cached_block_hash_to_block:
            return False
        block.block_hash, block.token_ids, block.group = block_hash, tuple(token_ids), group
        self.cached_block_hash_to_block[key] = block
        self._num_cached_free += block.ref_cnt == 0
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget an in-use block's hash (its K/V are about to change in place: context shift)."""
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[(block.group, block.block_hash)]
            block.block_hash = block.token_ids = None
            self._num_cached_free -= block.ref_cnt == 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that is free (blocks in use stay cached); returns how many."""
        dropped = [b for b in self.cached_block_hash_to_block.values() if b.ref_cnt == 0]
        for b in dropped:
            del self.cached_block_hash_to_block[(b.group, b.block_hash)]
            b.block_hash = b.token_ids = None
            self.free_block_queue.remove(b)  # unhashed now: evict these first
            self.free_block_queue.appendleft(b)
        self._num_cached_free -= len(dropped)
        return len(dropped)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold cached KV (evictable); O(1): a count kept as blocks are
        freed, touched, evicted, cached and uncached (``/v1/stats`` reads it every snapshot)."""
        return self._num_cached_free

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block, taking a free one out of the queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self._num_cached_free -= block.block_hash is not None
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the queue's tail
        in the order given (callers pass a table reversed so its tail is evicted first);
        unhashed blocks go to the head instead (reused before any cached block).

        Raises ``ValueError`` (changing nothing) when a block would drop below 0 (double free).
        """
        blocks = [b for b in ordered_blocks if not b.is_null]
        drops = Counter(b.block_id for b in blocks)
        for block in blocks:
            if block.ref_cnt < drops[block.block_id]:
                raise ValueError(f"double free of block {block.block_id} (ref_cnt={block.ref_cnt})")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)
                    self._num_cached_free += 1

    def get_usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def block_states(self) -> list[str]:
        """Per block id: ``"null"``, ``"free"``, ``"cached"`` (free, holding cached KV,
        evictable) or ``"used"`` (for dashboards)."""
        return ["null" if b.is_null else "used" if b.ref_cnt > 0 else "cached" if b.block_hash is not None else "free"
                for b in self.blocks]
