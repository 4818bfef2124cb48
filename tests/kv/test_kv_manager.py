"""Tests for llmd.daemon.kv: BlockPool, FreeKVCacheBlockQueue, KVCacheManager."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from llmd.daemon.kv import BlockPool, KVCacheBlock, KVCacheManager
from llmd.daemon.kv.block_pool import FreeKVCacheBlockQueue


# ---- FreeKVCacheBlockQueue ---------------------------------------------------------
def test_queue_order_remove_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append_n([blocks[0]])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 2, 0]
    q.check_links()
    with pytest.raises(ValueError):
        q.append(blocks[2])  # already queued
    for _ in range(5):
        q.popleft()
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[0])


# ---- BlockPool ---------------------------------------------------------------------
def test_pool_rejects_too_few_blocks():
    for n in (-1, 0, 1):
        with pytest.raises(ValueError):
            BlockPool(n)


def test_pool_null_block_never_allocated():
    pool = BlockPool(4)
    assert pool.num_usable_blocks == 3
    assert pool.block_states() == ["null", "free", "free", "free"]
    blocks = pool.get_new_blocks(3)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.block_states() == ["null", "used", "used", "used"]


def test_pool_get_new_blocks_too_many_takes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3


def test_pool_touch_and_free():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 0)
    assert pool.free_block_queue.get_all_free_blocks()[0] is b  # unhashed: reused first
    pool.touch([b])  # touching a free block takes it out of the queue
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([a, b])
    assert pool.get_num_free_blocks() == 4
    with pytest.raises(ValueError):
        pool.free_blocks([a])  # double free
    assert pool.get_num_free_blocks() == 4 and a.ref_cnt == 0


# ---- KVCacheManager ----------------------------------------------------------------
def test_manager_exact_fit_and_blocks_needed():
    m = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks = 16 tokens
    assert m.get_num_blocks_needed("r", 0) == 0
    assert m.get_num_blocks_needed("r", 1) == 1
    assert m.get_num_blocks_needed("r", 4) == 1
    assert m.get_num_blocks_needed("r", 5) == 2
    assert m.can_allocate("r", 16) and not m.can_allocate("r", 17)
    assert m.allocate_slots("r", 16) == [1, 2, 3, 4]
    assert m.num_free_blocks == 0 and m.usage == 1.0
    assert m.allocate_slots("r", 16) == []  # already covered
    assert m.allocate_slots("r", 3) == []  # shrinking is a no-op
    assert m.allocate_slots("r", 17) is None
    assert m.get_block_table("r") == [1, 2, 3, 4]
    m.check_integrity()


def test_manager_grow_incrementally():
    m = KVCacheManager(num_blocks=10, block_size=4)
    assert m.allocate_slots("a", 3) == [1]
    assert m.allocate_slots("a", 4) == []
    assert m.allocate_slots("a", 5) == [2]
    assert m.allocate_slots("b", 9) == [3, 4, 5]
    assert m.allocate_slots("a", 13) == [6, 7]
    assert m.get_block_table("a") == [1, 2, 6, 7]
    assert m.num_blocks_held("a") == 4 and m.num_blocks_held("zzz") == 0
    assert m.get_block_table("zzz") == []
    assert m.request_ids() == ["a", "b"]
    assert m.num_used_blocks == 7 and m.num_usable_blocks == 9
    assert m.usage == pytest.approx(7 / 9)
    m.check_integrity()


def test_manager_all_or_nothing():
    m = KVCacheManager(num_blocks=6, block_size=2)  # 5 usable
    m.allocate_slots("a", 6)  # 3 blocks
    before = (m.get_block_table("a"), m.num_free_blocks, m.block_pool.block_states())
    assert m.allocate_slots("a", 12) is None  # needs 3 more, only 2 free
    assert m.allocate_slots("b", 6) is None
    assert (m.get_block_table("a"), m.num_free_blocks, m.block_pool.block_states()) == before
    assert "b" not in m.request_ids()
    m.check_integrity()


def test_manager_free_reverse_order_and_idempotent():
    m = KVCacheManager(num_blocks=8, block_size=1, enable_caching=True, prefix_cache_seed=0)
    m.allocate_slots("a", 3)  # [1, 2, 3]
    m.cache_blocks("a", [10, 11, 12], 3)  # a's blocks are full and cached
    m.allocate_slots("b", 2)  # [4, 5], never cached
    m.free("a")
    free_ids = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    # untouched 6, 7 first; then a's cached table reversed: its tail block is evicted first.
    assert free_ids == [6, 7, 3, 2, 1]
    m.free("b")  # unhashed blocks go to the head: reused before any cached block
    assert [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()] == [4, 5, 6, 7, 3, 2, 1]
    m.free("a")  # double free / abort after finish: no-op
    m.free("never-seen")
    m.check_integrity()
    assert m.allocate_slots("c", 4) == [4, 5, 6, 7]
    assert m.block_pool.block_states() == ["null", "cached", "cached", "cached", "used", "used", "used", "used"]
    assert m.allocate_slots("d", 1) == [3] and m.block_pool.num_evictions == 1  # LRU: the chain's tail
    m.free("c")
    m.free("d")
    assert m.num_free_blocks == m.num_usable_blocks == 7
    assert m.usage == 0.0 and m.request_ids() == []
    m.check_integrity()


def test_manager_null_block_never_in_table():
    m = KVCacheManager(num_blocks=3, block_size=16)
    assert m.allocate_slots("a", 32) == [1, 2]
    assert m.allocate_slots("b", 1) is None
    assert 0 not in m.get_block_table("a")
    assert m.block_pool.block_states() == ["null", "used", "used"]


def test_manager_bad_args():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=1, block_size=16)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=4).allocate_slots("a", -1)


def test_check_integrity_detects_corruption():
    m = KVCacheManager(num_blocks=5, block_size=2)
    m.allocate_slots("a", 4)
    m.block_pool.blocks[1].ref_cnt = 2
    with pytest.raises(AssertionError):
        m.check_integrity()
    m.block_pool.blocks[1].ref_cnt = 1
    m.check_integrity()
    m.req_to_blocks["a"][0].append(m.block_pool.null_block)
    with pytest.raises(AssertionError, match="null block"):
        m.check_integrity()
    m.req_to_blocks["a"][0].pop()
    blk = m.block_pool.free_block_queue.get_all_free_blocks()[0]
    blk.next_free_block.prev_free_block = None
    with pytest.raises(AssertionError):
        m.check_integrity()


# ---- stateful model-based test -------------------------------------------------------
class KVCacheMachine(RuleBasedStateMachine):
    """Drives a KVCacheManager against a dict model: request id -> tokens covered."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.model: dict[str, int] = {}
        self.counter = 0

    def _blocks(self, tokens: int) -> int:
        assert self.m is not None
        return -(-tokens // self.m.block_size)

    def _model_used(self) -> int:
        return sum(self._blocks(t) for t in self.model.values())

    @initialize(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def init(self, num_blocks: int, block_size: int) -> None:
        self.m = KVCacheManager(num_blocks, block_size)

    @precondition(lambda self: self.m is not None)
    @rule(target=requests, num_tokens=st.integers(0, 80))
    def allocate(self, num_tokens: int) -> str:
        assert self.m is not None
        rid = f"r{self.counter}"
        self.counter += 1
        need = self._blocks(num_tokens)
        free_before = self.m.num_free_blocks
        got = self.m.allocate_slots(rid, num_tokens)
        if need > free_before:
            assert got is None and rid not in self.m.request_ids()
            assert self.m.num_free_blocks == free_before
        else:
            assert got is not None and len(got) == need
            self.model[rid] = num_tokens
        return rid

    @precondition(lambda self: self.m is not None)
    @rule(rid=requests, k=st.integers(0, 20))
    def append(self, rid: str, k: int) -> None:
        assert self.m is not None
        if rid not in self.model:
            return
        old_table = self.m.get_block_table(rid)
        target = self.model[rid] + k
        need = self._blocks(target) - len(old_table)
        free_before = self.m.num_free_blocks
        got = self.m.allocate_slots(rid, target)
        if need > free_before:
            assert got is None and self.m.get_block_table(rid) == old_table
            assert self.m.num_free_blocks == free_before
        else:
            assert got is not None and len(got) == max(0, need)
            assert self.m.get_block_table(rid) == old_table + got
            self.model[rid] = target

    @precondition(lambda self: self.m is not None)
    @rule(rid=consumes(requests))
    def finish(self, rid: str) -> None:
        assert self.m is not None
        self.m.free(rid)
        self.model.pop(rid, None)
        assert self.m.get_block_table(rid) == []

    @precondition(lambda self: self.m is not None)
    @rule(rid=requests)
    def abort(self, rid: str) -> None:
        # abort may hit an already finished request: must be a safe no-op then.
        assert self.m is not None
        self.m.free(rid)
        self.m.free(rid)
        self.model.pop(rid, None)

    @precondition(lambda self: self.m is not None)
    @rule()
    def free_all(self) -> None:
        assert self.m is not None
        for rid in list(self.model):
            self.m.free(rid)
        self.model.clear()
        assert self.m.num_free_blocks == self.m.num_usable_blocks
        assert self.m.usage == 0.0
        assert self.m.block_pool.block_states().count("free") == self.m.num_usable_blocks

    @invariant()
    def consistent(self) -> None:
        if self.m is None:
            return
        self.m.check_integrity()
        assert set(self.m.request_ids()) == set(self.model)
        for rid, tokens in self.model.items():
            assert self.m.num_blocks_held(rid) == self._blocks(tokens)
        assert self.m.num_used_blocks == self._model_used()
        assert 0.0 <= self.m.usage <= 1.0
        assert self.m.block_pool.block_states()[0] == "null"

    def teardown(self) -> None:
        if self.m is None:
            return
        for rid in list(self.model):
            self.m.free(rid)
        self.m.check_integrity()
        assert self.m.num_free_blocks == self.m.num_usable_blocks


KVCacheMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
