"""Sliding windows through the whole engine (Gemma 3 270M, float32, CPU: window 512, layers
5, 11, 17 global): chunked prefill is exact (case S1, Gemma part), memory stays bounded while
the tokens equal an engine that keeps every block (case W3 at engine level), and prefix-cache
hits across the window (case P3).

Engines are built from the session's already loaded Gemma 3 (``make_gemma_engine``, default
64 MiB pool: 681 usable blocks of 16 tokens x 3 layers). Prompts are BOS + seeded random
ordinary-token ids. Helpers come from test_engine_scheduling.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_scheduling import UNLIMITED, assert_idle, assert_same, drive, greedy, prefill_sizes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BS = 16
WINDOW = 512


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gemma_ids(n: int, seed: int, bos: bool = True) -> list[int]:
    """BOS (2) + random ordinary-token ids in [1,000, 250,000); ``n`` ids in all."""
    g = torch.Generator().manual_seed(seed)
    return ([2] if bos else []) + torch.randint(1000, 250_000, (n - bos,), generator=g).tolist()


# ---- S1 (Gemma 3): chunked prefill is exact --------------------------------------------
S1_LEN, S1_NEW = 1500, 8
S1_CHUNKS = (64, 511, 512, 513)


@pytest.fixture(scope="module")
def s1_prompt() -> list[int]:
    return gemma_ids(S1_LEN, seed=21)


@pytest.fixture(scope="module")
def s1_reference(make_gemma_engine, s1_prompt):
    """Unlimited chunk (the whole prompt in one step), prefix cache on; then the same prompt on
    the warm cache. Returns (cold, warm)."""
    eng = make_gemma_engine(max_num_batched_tokens=UNLIMITED, max_prefill_chunk=UNLIMITED, prefix_cache_seed=21)
    sizes = []
    cold = drive(eng, {"cold": (s1_prompt, greedy(S1_NEW))}, integrity=True, check=prefill_sizes(sizes))
    assert sizes == [S1_LEN]
    warm = drive(eng, {"warm": (s1_prompt, greedy(S1_NEW))}, integrity=True)
    assert_idle(eng)
    return cold["cold"], warm["warm"]


def test_s1_gemma_warm_prefix_cache_equals_cold(s1_reference):
    """The 1,500-token prompt again on the warm cache: 1,488 tokens served from the cache (the
    sliding groups' hit needs only the last 512 tokens' blocks), same 8 tokens, logprobs within 1e-4."""
    cold, warm = s1_reference
    assert cold["cached"] == 0 and warm["cached"] == 1488
    assert len(cold["tokens"]) == S1_NEW
    assert_same(warm, cold)


@pytest.mark.parametrize("chunk", S1_CHUNKS)
def test_s1_chunked_prefill_is_exact_gemma3(make_gemma_engine, s1_prompt, s1_reference, chunk):
    """Case S1 (Gemma 3, CI size: chunks 64, 511, 512, 513 vs unlimited, 8 new tokens): a
    1,500-token prompt prefilled in chunks of ``chunk`` (token budget = chunk cap) across the
    512-token window edges gives the unlimited run's greedy tokens and last-position logprobs
    (top 20) within 1e-4. Prefix cache alternately on/off; where on, a warm rerun is exact too."""
    cache_on = S1_CHUNKS.index(chunk) % 2 == 0
    eng = make_gemma_engine(max_num_batched_tokens=chunk, max_prefill_chunk=chunk, enable_prefix_caching=cache_on,
                            prefix_cache_seed=22)
    sizes = []
    out = drive(eng, {"r": (s1_prompt, greedy(S1_NEW))}, integrity=True, check=prefill_sizes(sizes))["r"]
    assert sizes == [min(chunk, S1_LEN - i) for i in range(0, S1_LEN, chunk)]
    cold, _ = s1_reference
    assert_same(out, cold, first_only=True)
    if cache_on:
        warm = drive(eng, {"w": (s1_prompt, greedy(S1_NEW))}, integrity=True)["w"]
        assert warm["cached"] == 1488
        assert_same(warm, cold, first_only=True)
    assert_idle(eng)


# ---- W3 at engine level, and P3 ------------------------------------------------------------
W3_LEN, W3_NEW, W3_BUDGET = 1200, 8, 256


@pytest.fixture(scope="module")
def w3_prompt() -> list[int]:
    return gemma_ids(W3_LEN, seed=31)


def run_logged(engine, rid: str, prompt: list[int], params) -> tuple[dict, list[dict]]:
    """Run one request alone; log, for every step, what its blocks were while the forward ran
    (recorded inside the runner call: after the step's allocation, before finished requests
    free theirs): the scheduled chunk, blocks held per group, free / used blocks. Integrity
    is checked after every step."""
    kv, log = engine.kv_manager, []
    execute = engine.runner.execute

    def logged_execute(so, *a, **kw):
        [s] = so.scheduled
        log.append({"prefill": s.is_prefill, "start": s.num_computed_tokens, "n": s.num_new_tokens,
                    "held": [kv.num_blocks_held(rid, g) for g in range(kv.num_groups)],
                    "free": kv.num_free_blocks, "used": kv.num_used_blocks})
        return execute(so, *a, **kw)

    engine.runner.execute = logged_execute
    try:
        out = drive(engine, {rid: (prompt, params)}, integrity=True)[rid]
    finally:
        del engine.runner.execute
    return out, log


@pytest.fixture(scope="module")
def w3_runs(make_gemma_engine, w3_prompt):
    """The 1,200-token prompt + 8 greedy tokens with a token budget of 256 on (a) the hybrid
    engine (1 full + 5 sliding groups, prefix cache on; P3 continues on it) and (b) one that
    keeps every block (``disable_hybrid_kv_cache_manager``, prefix cache off: also P3's
    cache-off reference for this prompt)."""
    hybrid = make_gemma_engine(max_num_batched_tokens=W3_BUDGET, prefix_cache_seed=31)
    h_out, h_log = run_logged(hybrid, "w3", w3_prompt, greedy(W3_NEW))
    assert_idle(hybrid)
    flat = make_gemma_engine(max_num_batched_tokens=W3_BUDGET, disable_hybrid_kv_cache_manager=True,
                             enable_prefix_caching=False)
    f_out, f_log = run_logged(flat, "w3", w3_prompt, greedy(W3_NEW))
    assert_idle(flat)
    return {"hybrid": hybrid, "h_out": h_out, "h_log": h_log, "flat": flat, "f_out": f_out, "f_log": f_log}


def test_w3_engine_memory_bounded_and_exact(w3_runs):
    """Case W3 at engine level: in every step of a 1,200 + 8 token run (prefill chunks of 256),
    the full group holds every block so far, each sliding group at most ceil((511 + C)/16) + 1
    blocks during a prefill chunk of C tokens and ceil(512/16) + 1 = 33 while decoding, and
    free = usable - full - sum(sliding) (nothing else is held); check_integrity after every
    step, everything free at the end. The engine that keeps every block gives the same tokens
    and logprobs (within 1e-4) while holding every block, about twice the bytes while decoding."""
    h, hlog, f, flog = w3_runs["hybrid"], w3_runs["h_log"], w3_runs["flat"], w3_runs["f_log"]
    kv = h.kv_manager
    assert [g.sliding_window for g in kv.groups] == [None] + [WINDOW] * 5
    chunks = [(i, min(256, W3_LEN - i)) for i in range(0, W3_LEN, 256)]
    assert [(e["start"], e["n"]) for e in hlog if e["prefill"]] == chunks
    assert sum(not e["prefill"] for e in hlog) == W3_NEW - 1
    for e in hlog:
        end = e["start"] + e["n"]
        full, *sliding = e["held"]
        assert full == cdiv(end, BS), e
        bound = cdiv(WINDOW - 1 + e["n"], BS) + 1 if e["prefill"] else cdiv(WINDOW, BS) + 1
        assert max(sliding) <= bound, (e, bound)
        assert e["used"] == full + sum(sliding) and e["free"] == kv.num_usable_blocks - e["used"], e
    last = hlog[-1]
    assert last["held"][1:] == [cdiv(WINDOW, BS) + 1] * 5  # decoding at 1,207: the bound is reached, not exceeded
    assert last["held"][0] == cdiv(W3_LEN + W3_NEW - 1, BS) == 76
    # the engine keeping every block: one group of 18 layers, every block of every token
    fkv = f.kv_manager
    assert len(fkv.groups) == 1 and fkv.groups[0].sliding_window is None
    for e in flog:
        assert e["held"] == [cdiv(e["start"] + e["n"], BS)] and e["used"] == e["held"][0], e
    h_bytes, f_bytes = last["used"] * h.block_bytes, flog[-1]["used"] * f.block_bytes
    assert f.block_bytes == 6 * h.block_bytes == 589_824
    assert h_bytes < 0.6 * f_bytes, (h_bytes, f_bytes)
    assert_same(w3_runs["h_out"], w3_runs["f_out"])


def test_p3_windows_and_prefix_cache(make_gemma_engine, w3_prompt, w3_runs):
    """Case P3: on the hybrid cache-on engine, a 1,200-token prompt (the W3 run), the same
    prompt again (1,184 cached: every full block but the last prompt token's; the sliding
    groups' blocks before the window were freed during the first run, yet still cached), then
    its first 1,024 tokens + a new 100-token tail (1,024 cached): each output equals the same
    prompt on a cache-off engine (8 greedy tokens, every token's top-20 logprobs within 1e-4)."""
    eng = w3_runs["hybrid"]
    first = w3_runs["h_out"]
    assert first["cached"] == 0
    assert_same(first, w3_runs["f_out"])
    again = drive(eng, {"p3-again": (w3_prompt, greedy(W3_NEW))}, integrity=True)["p3-again"]
    assert again["cached"] == (W3_LEN - 1) // BS * BS == 1184
    assert_same(again, w3_runs["f_out"])
    tail_prompt = w3_prompt[:1024] + gemma_ids(100, seed=32, bos=False)
    tail = drive(eng, {"p3-tail": (tail_prompt, greedy(W3_NEW))}, integrity=True)["p3-tail"]
    assert tail["cached"] == 1024
    assert_idle(eng)
    off = make_gemma_engine(enable_prefix_caching=False)
    ref = drive(off, {"ref": (tail_prompt, greedy(W3_NEW))})["ref"]
    assert ref["cached"] == 0
    assert_same(tail, ref)
