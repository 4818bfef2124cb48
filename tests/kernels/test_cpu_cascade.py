"""Cascade attention in the CPU fast path (``kernels/cpu_cascade.py``): decodes and prefill chunks
that share leading blocks attend to them once; results equal the float64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from llmd.kernels import AttentionMetadata, cpu_cascade, cpu_plan, ops, reference
from llmd.quant.kv import PagedKVCache, get_format

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # those of test_cpu_attention.py


def shared_prefix_step(block_size: int, group: int, fmt: str, dtype, seed: int, prefill: bool = True):
    """Two families of decodes sharing 5 and 7 leading blocks (plus unshared tails of varied
    lengths), two loners, and (optionally) a prefill chunk whose context is the first family's
    5 blocks (so it joins that cascade).

    Returns ``(meta, query [T, heads, 64] float32, cache)``."""
    g = torch.Generator().manual_seed(seed)
    bs, nkv, hd = block_size, 2, 64
    fam = [(5, [1, 9, bs, 3 * bs + 2]), (7, [2, bs - 1, 2 * bs + 5])]  # (shared blocks, tail tokens per member)
    seqs = []  # (table blocks, seq_len, query_len)
    next_block = 1
    for shared, tails in fam:
        prefix = list(range(next_block, next_block + shared))
        next_block += shared
        for tail in tails:
            n = -(-tail // bs)
            seqs.append((prefix + list(range(next_block, next_block + n)), shared * bs + tail, 1))
            next_block += n
    for length in (3 * bs + 4, 40):  # loners
        n = -(-length // bs)
        seqs.append((list(range(next_block, next_block + n)), length, 1))
        next_block += n
    if prefill:  # a prefill chunk over the first family's prefix: a member of its cascade
        seqs.append((seqs[0][0][:5] + [next_block], 5 * bs + 7, 7))
        next_block += 1
    num_blocks = next_block + 2
    perm = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(num_blocks - 1, generator=g) + 1])
    width = max(len(t) for t, _, _ in seqs) + 1
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (t, _, _) in enumerate(seqs):
        tables[i, : len(t)] = perm[torch.tensor(t)].int()
    name, _, group_size = fmt.partition("/g")  # "int8/g32": --kv-scale-group-size 32
    cache = PagedKVCache.allocate((2, num_blocks, bs, nkv, hd), get_format(name, int(group_size or 0)), dtype, "cpu")
    written, new_slots = set(), []
    for i, (t, length, q) in enumerate(seqs):
        pos = torch.arange(length)
        slots = tables[i, pos // bs].long() * bs + pos % bs
        fresh = torch.tensor([s not in written for s in slots.tolist()])
        k, v = torch.randn(length, nkv, hd, generator=g) * 2, torch.randn(length, nkv, hd, generator=g)
        reference.store_kv(k[fresh], v[fresh], cache, slots[fresh])  # shared blocks written once
        written.update(slots.tolist())
        new_slots.append(slots[length - q :])
    qlens = [q for _, _, q in seqs]
    lens = [n for _, n, _ in seqs]
    query = torch.randn(sum(qlens), nkv * group, hd, generator=g)
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32)
    meta = AttentionMetadata(torch.cat(new_slots), tables, qsl, torch.tensor(lens, dtype=torch.int32),
                             qlens, lens, bs, "cpu")
    return meta, query, cache


@pytest.mark.parametrize("block_size,group,fmt,dtype,prefill", [
    (16, 3, "auto", torch.float32, True), (16, 1, "int8", torch.float32, False),
    (32, 4, "fp8_e4m3", torch.float32, True), (16, 3, "auto", torch.bfloat16, False),
    (32, 3, "int8", torch.bfloat16, True), (16, 8, "fp8_e5m2", torch.float32, True),
    (16, 4, "int8/g32", torch.float32, True),
])
def test_cascade_matches_float64_reference(block_size, group, fmt, dtype, prefill):
    meta, query, cache = shared_prefix_step(block_size, group, fmt, dtype, block_size * 10 + group, prefill)
    q = query.to(dtype)
    out = ops.paged_attention(q, cache, meta, 0.125, None)
    plan = cpu_plan.get_plan(meta, 2, None, group)
    assert sorted(c.prefix_len // block_size for c in plan.cascades) == [5, 7]  # both families found, loners not
    assert sorted(len(c.members) for c in plan.cascades) == ([3, 5] if prefill else [3, 4])
    assert (plan.chunk_tails is not None) == prefill and len(plan.prefills) == 0
    ref = reference.paged_attention(q.double(), cache, meta, 0.125, None, compute_dtype=torch.float64)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and err <= TOL[dtype]


def test_cascade_equals_the_plain_batched_path():
    """Same step with the cascade switched off (min blocks out of reach): float32 outputs agree
    to rounding, so the merge is the same softmax."""
    meta, query, cache = shared_prefix_step(16, 3, "int8", torch.float32, seed=5)
    with_cascade = ops.paged_attention(query, cache, meta, 0.125, None)
    meta.plans.clear()
    old = cpu_cascade.CASCADE_MIN_BLOCKS
    cpu_cascade.CASCADE_MIN_BLOCKS = 10**6
    try:
        plain = ops.paged_attention(query, cache, meta, 0.125, None)
        assert not cpu_plan.get_plan(meta, 2, None, 3).cascades
    finally:
        cpu_cascade.CASCADE_MIN_BLOCKS = old
    assert (with_cascade - plain).abs().max().item() <= 1e-5 * plain.abs().max().item()


def test_find_cascades_rules():
    rows = lambda t, f, n, bs, h: torch.arange(n * h)  # noqa: E731 (the rows are not under test here)
    lens = torch.tensor([100, 100, 100, 70, 65, 100])
    tables = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 11, 12], [3, 4, 5, 6, 7, 8, 13],
                           [0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [20, 4, 5, 6, 7, 8, 9]], dtype=torch.int32)
    (c,) = cpu_cascade.find_cascades(tables, lens, 16, 2, rows)
    assert c.members.tolist() == [0, 1, 2] and c.prefix_len == 5 * 16  # common 5 blocks; null block 0 never
    # the shared prefix stops before each member's last key: a 65-token member caps it at 4 blocks
    (c,) = cpu_cascade.find_cascades(tables[:2], torch.tensor([100, 65]), 16, 2, rows)
    assert c.prefix_len == 4 * 16
    assert cpu_cascade.find_cascades(tables[:2], torch.tensor([100, 60]), 16, 2, rows) == []  # 3 blocks < min
    # a member whose first query comes before 4 blocks is left out, not a cap on the others
    (c,) = cpu_cascade.find_cascades(tables[:3], torch.tensor([100, 100, 40]), 16, 2, rows)
    assert c.members.tolist() == [0, 1] and c.prefix_len == 5 * 16
    assert cpu_cascade.find_cascades(tables[[0, 5]], lens[[0, 5]], 16, 2, rows) == []  # different first blocks


def test_sliding_window_and_int4_plans_have_no_cascade():
    meta, query, cache = shared_prefix_step(16, 3, "auto", torch.float32, seed=2)
    ops.paged_attention(query, cache, meta, 0.125, 40)
    assert not cpu_plan.get_plan(meta, 2, 40, 3).cascades
    assert not cpu_plan.build_plan(meta, 2, None, 3, cascade_ok=False).cascades


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "auto"), (torch.bfloat16, "int8"), (torch.float32, "fp8_e4m3")])
def test_prefill_chunks_on_one_cached_prompt_attend_to_it_once(dtype, fmt):
    """Many chats arriving on one cached system prompt (the shared-prefix workload): each
    chunk's context is the prompt's 8 full blocks (or those plus a few tokens of its own block),
    its queries a short question; with decodes of earlier chats of the same prompt and one chat
    computing the prompt itself (context 0: left out). All but that one form a cascade; the
    outputs equal the float64 reference."""
    g = torch.Generator().manual_seed(13)
    bs, nkv, hd, group, shared = 16, 2, 64, 3, 8
    seqs = []  # (own blocks after the prefix, context, query_len)
    for ctx_extra, q in ((0, 11), (5, 17), (0, 3), (9, 30)):  # prefill chunks
        seqs.append((shared * bs + ctx_extra, q))
    for tail in (1, 20, 37):  # decodes
        seqs.append((shared * bs + tail - 1, 1))
    next_block = 1 + shared
    tables, new_slots, lens = [], [], []
    cache = PagedKVCache.allocate((2, 64, bs, nkv, hd), get_format(fmt), dtype, "cpu")
    k, v = torch.randn(shared * bs, nkv, hd, generator=g) * 2, torch.randn(shared * bs, nkv, hd, generator=g)
    reference.store_kv(k, v, cache, torch.arange(bs, (1 + shared) * bs))  # the prompt: blocks 1..8
    for ctx, q in seqs + [(0, 40)]:  # the last: a chat computing the prompt itself, own blocks only
        n = -(-(ctx + q) // bs)
        own = list(range(next_block, next_block + n - (shared if ctx else 0)))
        next_block += len(own)
        table = (list(range(1, 1 + shared)) if ctx else []) + own
        pos = torch.arange(shared * bs if ctx else 0, ctx + q)
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        reference.store_kv(torch.randn(len(pos), nkv, hd, generator=g), torch.randn(len(pos), nkv, hd, generator=g),
                           cache, slots)
        tables.append(table)
        new_slots.append(slots[len(pos) - q:])
        lens.append(ctx + q)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qlens = [q for _, q in seqs] + [40]
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32)
    meta = AttentionMetadata(torch.cat(new_slots), bt, qsl, torch.tensor(lens, dtype=torch.int32), qlens, lens, bs,
                             "cpu")
    query = torch.randn(sum(qlens), nkv * group, hd, generator=g).to(dtype)
    out = ops.paged_attention(query, cache, meta, 0.125, None)
    (c,) = cpu_plan.get_plan(meta, nkv, None, group).cascades
    assert c.members.tolist() == list(range(7)) and c.prefix_len == shared * bs
    assert c.tokens.tolist() == list(range(sum(qlens) - 40))
    ref = reference.paged_attention(query.double(), cache, meta, 0.125, None, compute_dtype=torch.float64)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and err <= TOL[dtype]
