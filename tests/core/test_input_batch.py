"""The vectorized step preparation (daemon/core/input_batch.py) equals a per-token reference."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from llmd.daemon.core.input_batch import InputBatch
from llmd.daemon.core.model_runner import ModelRunner
from llmd.daemon.core.outputs import ScheduledRequest, SchedulerOutput
from llmd.daemon.kv import make_kv_cache_groups


def reference_inputs(out: SchedulerOutput, num_groups: int, bs: int):
    """The straightforward per-token build (what the runner did before it was vectorized)."""
    ids, positions, qlens, seq_lens, logits_indices = [], [], [], [], []
    for s in out.scheduled:
        start, n = s.num_computed_tokens, s.num_new_tokens
        ids.extend(s.token_ids)
        positions.extend(range(start, start + n))
        qlens.append(n)
        seq_lens.append(start + n)
        if s.sample:
            logits_indices.append(len(ids) - 1)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    groups = []
    for g in range(num_groups):
        tables_py = [s.block_tables[g] for s in out.scheduled]
        tables = torch.zeros(len(tables_py), max(len(t) for t in tables_py), dtype=torch.int32)
        slots = []
        for b, (s, table) in enumerate(zip(out.scheduled, tables_py)):
            tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
            slots.extend(table[p // bs] * bs + p % bs
                         for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
        groups.append((torch.tensor(slots, dtype=torch.int64), tables))
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
            torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), qlens, seq_lens,
            logits_indices, groups)


def random_step(rng: random.Random, num_groups: int, bs: int, max_seqs: int = 8, max_chunk: int = 40,
                window_blocks: int = 3) -> SchedulerOutput:
    """Mixed decodes and prefill chunks; group 1+ act as sliding-window groups (leading null
    blocks); tables may hold more blocks than this step needs; block ids up to 10^6."""
    out = SchedulerOutput()
    for i in range(rng.randint(1, max_seqs)):
        start = rng.randint(0, 300)
        n = 1 if rng.random() < 0.5 else rng.randint(1, max_chunk)
        need = -(-(start + n) // bs) + rng.randint(0, 2)
        tables = []
        for g in range(num_groups):
            t = [rng.randint(1, 10**6) for _ in range(need)]
            if g > 0:  # a window dropped the blocks before (start // bs - window_blocks)
                drop = max(0, start // bs - window_blocks)
                t[:drop] = [0] * drop
            tables.append(t)
        ids = [rng.randint(0, 49151) for _ in range(n)]
        out.scheduled.append(ScheduledRequest(f"r{i}", ids, start, tables, sample=rng.random() < 0.8,
                                              is_prefill=n > 1))
    return out


def check_equal(step, ref, num_groups):
    ids, pos, qsl, sl, qlens, seq_lens, logits_indices, groups = ref
    assert torch.equal(step.input_ids, ids) and step.input_ids.dtype == torch.int64
    assert torch.equal(step.positions, pos) and step.positions.dtype == torch.int64
    assert step.logits_indices == logits_indices
    assert len(step.metas) == num_groups
    for m, (slots, tables) in zip(step.metas, groups):
        assert m.slot_mapping.dtype == torch.int64 and torch.equal(m.slot_mapping, slots)
        assert m.block_tables.dtype == torch.int32 and torch.equal(m.block_tables, tables)
        assert m.block_tables.is_contiguous()
        assert m.query_start_loc.dtype == torch.int32 and torch.equal(m.query_start_loc, qsl)
        assert m.seq_lens.dtype == torch.int32 and torch.equal(m.seq_lens, sl)
        assert m.query_lens_cpu == qlens and m.seq_lens_cpu == seq_lens
        assert m.slots_padded is False and bool((m.slot_mapping >= 0).all())  # store_kv skips its check
        assert type(m.query_lens_cpu) is list and type(m.seq_lens_cpu) is list


@pytest.mark.parametrize("num_groups,bs", [(1, 16), (2, 16), (3, 32)])
def test_prepare_equals_the_per_token_reference(num_groups, bs):
    """Random mixed steps, one buffer set reused across them (small initial sizes, so they
    grow and shrink back): every field equals the per-token build."""
    rng = random.Random(num_groups * 100 + bs)
    batch = InputBatch(num_groups, bs, torch.device("cpu"), "torch", max_num_seqs=2, max_num_batched_tokens=8,
                       max_blocks_per_seq=2)
    for _ in range(60):
        out = random_step(rng, num_groups, bs)
        check_equal(batch.prepare(out), reference_inputs(out, num_groups, bs), num_groups)


def test_a_small_step_after_a_large_one_sees_no_stale_entries():
    """Zero padding of the block tables and every slot are rewritten each step."""
    rng = random.Random(7)
    batch = InputBatch(2, 16, torch.device("cpu"), "torch")
    big = random_step(rng, 2, 16, max_seqs=8, max_chunk=200)
    batch.prepare(big)
    small = SchedulerOutput([ScheduledRequest("a", [5], 40, [[3, 9, 11], [0, 0, 12]], True, False),
                             ScheduledRequest("b", [6, 7], 0, [[4], [8]], True, True)])
    step = batch.prepare(small)
    check_equal(step, reference_inputs(small, 2, 16), 2)
    assert step.metas[0].block_tables.tolist() == [[3, 9, 11], [4, 0, 0]]
    assert step.metas[1].slot_mapping.tolist() == [12 * 16 + 8, 8 * 16, 8 * 16 + 1]
    assert step.positions.tolist() == [40, 0, 1] and step.logits_indices == [0, 2]
    one = SchedulerOutput([ScheduledRequest("a", [9], 47, [[3, 9, 11, 13], [0, 0, 12, 14]], True, False)])
    step = batch.prepare(one)  # the single-token path
    check_equal(step, reference_inputs(one, 2, 16), 2)
    assert step.metas[1].slot_mapping.tolist() == [12 * 16 + 15]
    assert step.metas[1].block_tables.tolist() == [[0, 0, 12, 14]]


def test_runner_maps_each_layer_to_its_groups_metadata():
    """ModelRunner.prepare_inputs: one AttentionMetadata for one group, else one per layer
    (its group's), as before the vectorization."""
    windows = (None, 4, 4, 4, None, 4)  # Gemma-like: 2 global, 4 local layers -> 3 groups of 2
    cfg = SimpleNamespace(num_layers=6, num_kv_heads=1, head_dim=8, sliding_window=windows)
    model = SimpleNamespace(config=cfg)
    groups = make_kv_cache_groups(windows)
    runner = ModelRunner(model, 8, 16, torch.float32, "cpu", kv_cache_groups=groups)
    rng = random.Random(3)
    out = random_step(rng, len(groups), 16)
    ids, pos, meta, li = runner.prepare_inputs(out)
    ref = reference_inputs(out, len(groups), 16)
    assert isinstance(meta, list) and len(meta) == 6
    for layer, m in enumerate(meta):
        slots, tables = ref[7][runner.layer_group[layer]]
        assert torch.equal(m.slot_mapping, slots) and torch.equal(m.block_tables, tables)
    single = ModelRunner(model, 8, 16, torch.float32, "cpu")
    out1 = random_step(rng, 1, 16)
    _, _, meta1, _ = single.prepare_inputs(out1)
    assert not isinstance(meta1, list) and torch.equal(meta1.slot_mapping, reference_inputs(out1, 1, 16)[7][0][0])
