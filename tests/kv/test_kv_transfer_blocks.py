"""Block bookkeeping of prefill/decode disaggregation (``daemon/kv/transfer.py``): which blocks
a consumer imports per KV cache group, pins on the producer, allocation on the consumer; the
KV manager's audit holds throughout and every block comes back."""

from __future__ import annotations

import pytest

from llmd.daemon.kv import KVCacheGroupSpec, KVCacheManager
from llmd.daemon.kv.transfer import (
    allocate_imported,
    import_ranges,
    imported_block_ids,
    pin_blocks,
    pin_id_of,
    pinned_block_ids,
)

BS = 4
FULL = KVCacheGroupSpec("full_attention", (0,))
SLIDE = KVCacheGroupSpec("sliding_window_8", (1,), 8)


def test_import_ranges_keep_only_what_the_last_prompt_token_sees():
    # P = 23: tokens 0..21 imported, 22 recomputed; its query sees [22 - 8 + 1, 22] = [15, 22]
    assert import_ranges([FULL, SLIDE], 23, BS) == [(0, 6), (15 // BS, 6)]
    assert import_ranges([FULL, SLIDE], 8, BS) == [(0, 2), (0, 2)]  # window covers everything
    with pytest.raises(ValueError):
        import_ranges([FULL], 1, BS)


def test_pin_outlives_the_request_and_frees_once():
    kv = KVCacheManager(16, BS, [FULL, SLIDE])
    assert kv.allocate_slots("r", 23) is not None
    kv.remove_skipped_blocks("r", 22)
    used = kv.num_used_blocks
    assert pin_blocks(kv, "r", pin_id_of("r"))
    kv.free("r")
    kv.check_integrity()
    assert kv.num_used_blocks == used  # the pin holds every block
    ids = pinned_block_ids(kv, pin_id_of("r"), import_ranges(kv.groups, 23, BS))
    assert [len(x) for x in ids] == [6, 6 - 15 // BS]
    kv.free(pin_id_of("r"))
    kv.check_integrity()
    assert kv.num_used_blocks == 0
    assert not pin_blocks(kv, "gone", pin_id_of("gone"))


def test_pinned_ids_refuse_a_dropped_block():
    kv = KVCacheManager(32, BS, [FULL, SLIDE])
    assert kv.allocate_slots("r", 40) is not None
    kv.remove_skipped_blocks("r", 39)  # generated far past the prompt: the window moved on
    pin_blocks(kv, "r", "pin")
    with pytest.raises(ValueError, match="sliding window"):
        pinned_block_ids(kv, "pin", import_ranges(kv.groups, 23, BS))


def test_allocate_imported_nulls_the_head_of_sliding_tables():
    kv = KVCacheManager(16, BS, [FULL, SLIDE], enable_caching=True)
    ranges = import_ranges(kv.groups, 23, BS)
    new = allocate_imported(kv, "c", 23, ranges, cache_salt="s")
    kv.check_integrity()
    assert new == imported_block_ids(kv, "c", ranges)
    assert [len(t) for t in kv.get_block_tables("c")] == [6, 6]
    assert kv.get_block_table("c", 1)[:3] == [0, 0, 0] and 0 not in kv.get_block_table("c", 1)[3:]
    assert kv.num_used_blocks == 6 + 3
    kv.allocate_slots("c", 24, 23)  # decoding continues like any request
    kv.check_integrity()
    kv.free("c")
    assert kv.num_used_blocks == 0


def test_allocate_imported_is_all_or_nothing():
    kv = KVCacheManager(8, BS, [FULL, SLIDE])  # 7 usable blocks, 9 needed
    assert allocate_imported(kv, "c", 23, import_ranges(kv.groups, 23, BS)) is None
    assert kv.num_used_blocks == 0 and "c" not in kv.req_to_blocks
    with pytest.raises(ValueError):  # a full-attention table cannot start with null blocks
        allocate_imported(kv, "d", 23, [(1, 6), (3, 6)])


def test_int4_imports_full_blocks_only_and_takes_a_residual_slot():
    """int4 (its open-block residual does not travel): the consumer imports the full blocks before
    the last prompt token's block (P = 23, blocks of 4: tokens 0..19; P = 21: 0..19; P = 4: none)
    and the sliding ranges start at what a query at the first recomputed token sees ([12, 19]
    for 20); allocation takes one residual slot per group, all or nothing."""
    from llmd.daemon.kv.transfer import imported_tokens

    assert [imported_tokens(p, BS, True) for p in (23, 21, 20, 5, 4)] == [20, 20, 16, 4, 0]
    assert [imported_tokens(p, BS) for p in (23, 21)] == [22, 20]
    assert import_ranges([FULL, SLIDE], 23, BS, full_blocks_only=True) == [(0, 6), ((20 - 8 + 1) // BS, 6)]
    kv = KVCacheManager(16, BS, [FULL, SLIDE], num_residual_slots=2)
    ranges = import_ranges(kv.groups, 23, BS, full_blocks_only=True)
    assert allocate_imported(kv, "a", 23, ranges) is not None
    assert len(kv.residual_slots("a")) == 2 and not kv.free_residual_slots
    used = kv.num_used_blocks
    assert allocate_imported(kv, "b", 23, ranges) is None  # no residual slot left: nothing taken
    assert "b" not in kv.req_to_blocks and kv.num_used_blocks == used
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity()
    assert kv.num_used_blocks == 0 and len(kv.free_residual_slots) == 2
