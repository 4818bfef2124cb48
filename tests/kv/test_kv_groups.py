"""KV cache groups: grouping, window bounds (case W3 at the KV-manager level), capacity math,
and an engine run whose sliding-window groups free blocks yet give the same tokens."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.daemon.core.kv_size import kv_size_rows
from llmd.daemon.core.request import SamplingParams
from llmd.daemon.kv import KVCacheManager, layer_placement, make_kv_cache_groups
from llmd.models.config import ModelConfig

GEMMA_WINDOWS = tuple(None if i % 6 == 5 else 512 for i in range(18))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_gemma3_layout_is_one_full_and_five_sliding_groups():
    groups = make_kv_cache_groups(GEMMA_WINDOWS)
    assert [g.name for g in groups] == ["full_attention"] + [f"sliding_window_512.{k}" for k in range(5)]
    assert groups[0].layer_ids == (5, 11, 17) and groups[0].sliding_window is None
    assert all(len(g.layer_ids) == 3 and g.sliding_window == 512 for g in groups[1:])
    assert sorted(i for g in groups for i in g.layer_ids) == list(range(18))
    size, place = layer_placement(groups)
    assert size == 3 and place[5] == (0, 0) and place[17] == (0, 2) and place[0] == (1, 0)
    [single] = make_kv_cache_groups(GEMMA_WINDOWS, hybrid=False)
    assert single.sliding_window is None and single.layer_ids == tuple(range(18))
    assert len(make_kv_cache_groups((None,) * 30)) == 1


@pytest.mark.parametrize("bs", [16, 32])
def test_window_bounds(bs):
    g = make_kv_cache_groups(GEMMA_WINDOWS)[1]
    assert g.max_blocks(4000, bs, 1) == cdiv(512, bs) + 1
    assert g.max_blocks(4000, bs, 256) == cdiv(511 + 256, bs) + 1
    assert g.max_blocks(20, bs, 256) == cdiv(20, bs)  # short sequences never exceed their length
    assert make_kv_cache_groups(GEMMA_WINDOWS)[0].max_blocks(4000, bs, 1) == cdiv(4000, bs)


def gemma3_270m_config(**kw) -> ModelConfig:
    base = dict(architecture="gemma3", name="gemma3-270m", num_layers=18, hidden_size=640, intermediate_size=2048,
                num_heads=4, num_kv_heads=1, head_dim=256, vocab_size=262144, rope_theta=1e6, rms_norm_eps=1e-6,
                max_position=32768, tie_word_embeddings=True, sliding_window=GEMMA_WINDOWS)
    base.update(kw)
    return ModelConfig(**base)


def test_capacity_math_gemma3_hybrid_vs_global():
    """Issue 5: 18,432 B/token all-global in 16-bit; 32,768 tokens need ≈109 MB hybrid vs 604 MB."""
    cfg = gemma3_270m_config()
    mem = 2**30
    hybrid = {r.name: r for r in kv_size_rows(cfg, 32768, mem, 16, hybrid=True)}["bf16/fp16"]
    flat = {r.name: r for r in kv_size_rows(cfg, 32768, mem, 16, hybrid=False)}["bf16/fp16"]
    assert hybrid.bytes_per_token == flat.bytes_per_token == 18432
    assert flat.bytes_per_sequence == 18432 * 32768  # 604 MB
    # full group: 2048 blocks; 5 sliding groups: 33 blocks each; one block = 16 tokens x 3 layers x 1,024 B
    assert hybrid.bytes_per_sequence == (2048 + 5 * 33) * 16 * 3 * 1024
    assert round(hybrid.bytes_per_sequence / 1e6) == 109 and round(flat.bytes_per_sequence / 1e6) == 604
    assert hybrid.num_blocks == mem // (16 * 3 * 1024) and flat.num_blocks == mem // (16 * 18 * 1024)


def run_sequence(m: KVCacheManager, rid: str, total: int, chunk: int) -> list[list[int]]:
    """Prefill ``total`` tokens in ``chunk``s then decode 1 at a time; per step the real blocks
    held per group, checked against the window bounds."""
    held_log = []
    computed = 0
    while computed < total:
        n = min(chunk if computed < total // 2 else 1, total - computed)  # chunks, then decodes
        assert m.allocate_slots(rid, computed + n, computed) is not None
        m.check_integrity()
        held = [m.num_blocks_held(rid, g) for g in range(m.num_groups)]
        for g, spec in enumerate(m.groups):
            table = m.get_block_table(rid, g)
            assert len(table) == cdiv(computed + n, m.block_size)
            if spec.sliding_window is not None:
                lo = max(0, computed - spec.sliding_window + 1)
                assert all(b == 0 for b in table[: lo // m.block_size])  # dropped: null block
                assert all(b != 0 for b in table[lo // m.block_size :])  # every visible key kept
                assert held[g] <= cdiv(spec.sliding_window - 1 + n, m.block_size) + 1
            else:
                assert held[g] == len(table)
        held_log.append(held)
        computed += n
    return held_log


@pytest.mark.parametrize("bs,chunk", [(16, 256), (16, 64), (32, 100), (16, 513)])
def test_w3_sliding_groups_stay_bounded_in_a_4000_token_sequence(bs, chunk):
    """Case W3 at the KV-manager level: decode holds ≤ ceil(512/bs)+1 blocks per sliding group,
    a chunk of C ≤ ceil((511+C)/bs)+1; the full group keeps everything; all freed at the end."""
    groups = make_kv_cache_groups(GEMMA_WINDOWS)
    m = KVCacheManager(6 * cdiv(4000, bs) + 1, bs, groups)
    log = run_sequence(m, "r", 4000, chunk)
    decode_peak = max(h[1] for h in log[-100:])
    assert decode_peak == cdiv(512, bs) + 1 or (512 % bs == 0 and decode_peak == 512 // bs + 1)
    assert log[-1][0] == cdiv(4000, bs)
    assert m.num_used_blocks == cdiv(4000, bs) + sum(log[-1][1:])
    m.free("r")
    m.check_integrity()
    assert m.num_free_blocks == m.num_usable_blocks


@settings(max_examples=40, deadline=None)
@given(
    window=st.integers(1, 70), bs=st.sampled_from([1, 4, 16]),
    plan=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=30),
)
def test_hypothesis_groups_never_leak(window, bs, plan):
    """Several requests advancing by random chunks, some freed midway: tables obey the window,
    check_integrity holds after every call, and everything is free at the end."""
    windows = (None, window, window, None)
    m = KVCacheManager(400, bs, make_kv_cache_groups(windows))
    computed: dict[str, int] = {}
    for rid_i, n in plan:
        rid = f"r{rid_i}"
        if n > 35:  # sometimes finish the request
            m.free(rid)
            computed.pop(rid, None)
        else:
            c = computed.get(rid, 0)
            if m.allocate_slots(rid, c + n, c) is not None:
                computed[rid] = c + n
        m.check_integrity()
        for r, c in computed.items():
            for g, spec in enumerate(m.groups):
                if spec.sliding_window is not None:
                    bound = cdiv(window - 1 + max(1, c), bs) + 1
                    assert m.num_blocks_held(r, g) <= max(bound, cdiv(c, bs))
    for r in list(computed):
        m.free(r)
    m.check_integrity()
    assert m.num_free_blocks == m.num_usable_blocks


@contextlib.contextmanager
def with_windows(model, windows):
    """Temporarily give the session's SmolLM2 per-layer sliding windows (model and config)."""
    old_cfg = model.config
    old = [layer.self_attn.sliding_window for layer in model.layers]
    model.config = dataclasses.replace(old_cfg, sliding_window=tuple(windows))
    for layer, w in zip(model.layers, windows):
        layer.self_attn.sliding_window = w
    try:
        yield
    finally:
        model.config = old_cfg
        for layer, w in zip(model.layers, old):
            layer.self_attn.sliding_window = w


def test_engine_hybrid_groups_match_keep_everything(smollm2, make_engine):
    """SmolLM2 with a 40-token window on 2 of every 3 layers: the hybrid layout (1 full + 2
    sliding groups that free blocks) gives exactly the tokens and logprobs of one group that
    keeps every block, chunked prefill included; integrity after every step; all freed."""
    model, _ = smollm2
    windows = [None if i % 3 == 2 else 40 for i in range(30)]
    prompts = [list(range(100, 100 + n)) for n in (150, 37)]
    results = {}
    with with_windows(model, windows):
        for hybrid in (True, False):
            eng = make_engine(max_num_batched_tokens=48, disable_hybrid_kv_cache_manager=not hybrid)
            assert len(eng.kv_manager.groups) == (3 if hybrid else 1)
            sp = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
            for p in prompts:
                eng.add_request(p, sp)
            outs, max_sliding = {}, 0
            while eng.has_unfinished_requests():
                for o in eng.step():
                    outs.setdefault(o.request_id, []).extend((t, lp.top) for t, lp in zip(o.new_token_ids, o.logprobs))
                eng.kv_manager.check_integrity()
                for rid in eng.kv_manager.request_ids():
                    if hybrid:
                        max_sliding = max(max_sliding, eng.kv_manager.num_blocks_held(rid, 1))
            assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_usable_blocks
            if hybrid:
                assert max_sliding <= cdiv(39 + 48, 16) + 1 < cdiv(158, 16)
            results[hybrid] = [outs[k] for k in sorted(outs)]
    for a, b in zip(results[True], results[False]):
        assert [t for t, _ in a] == [t for t, _ in b]
        for (_, ta), (_, tb) in zip(a, b):
            assert [t for t, _ in ta] == [t for t, _ in tb]
            assert max(abs(x - y) for (_, x), (_, y) in zip(ta, tb)) < 1e-5
