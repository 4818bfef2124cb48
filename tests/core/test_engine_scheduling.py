"""Scheduling on the real engine (SmolLM2, float32, CPU): chunked prefill is exact (case S1),
preemption is invisible (S2), parallel sampling under pressure (S3), batch invariance (S4),
decodes keep flowing while a long prompt is chunked, and up-front rejection of a request that
fits the context but never the pool.

Every engine is built from the session's already loaded SmolLM2 (``make_engine``); prompts are
seeded random token ids, so runs are reproducible. Outputs are compared as token ids plus the
top logprobs of every sampled token (the raw model distribution, so the first one is the
last prompt position's logits up to a constant).

Sizes are CI sizes (1 CPU thread): see each test's docstring.
"""

from __future__ import annotations

import pytest
import torch

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.request import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SMOL_BLOCK_BYTES = 16 * 46080  # one float32 SmolLM2 block of 16 tokens (737,280 B)
TOL = 1e-4  # fp32: logprobs of different schedules agree to this
UNLIMITED = 2048  # a token budget / chunk larger than any prompt here


def smol_pool(num_usable_blocks: int) -> int:
    """``kv_cache_memory`` for exactly ``num_usable_blocks`` SmolLM2 float32 blocks (+ the null block)."""
    return (num_usable_blocks + 1) * SMOL_BLOCK_BYTES


def rand_ids(n: int, seed: int, lo: int = 100, hi: int = 40_000, bos: int | None = 1) -> list[int]:
    """``n`` seeded random token ids in [lo, hi), starting with ``bos`` unless None."""
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(lo, hi, (n - (bos is not None),), generator=g).tolist()
    return ([bos] if bos is not None else []) + body


def greedy(max_tokens: int, logprobs: int | None = 20, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs, **kw)


def drive(engine, requests: dict[str, tuple[list[int], SamplingParams]] | None = None, check=None,
          integrity: bool = False) -> dict[str, dict]:
    """Queue ``requests`` (id -> (prompt, params)) and step the engine until it is idle.

    ``check(engine)`` runs after every step. Returns per request id: ``tokens`` (streamed
    new_token_ids, concatenated), ``top`` (per token, the top logprob pairs), ``text``,
    ``cached`` (num_cached_tokens), ``finish`` (finish_reason), ``num_output`` (the last
    output's num_output_tokens), ``req`` (the Request object) and ``deltas`` (one list of
    token ids per output received).
    """
    out: dict[str, dict] = {}
    for rid, (prompt, params) in (requests or {}).items():
        engine.add_request(list(prompt), params, request_id=rid)
    for rid, req in engine.scheduler.requests.items():
        out.setdefault(rid, {"tokens": [], "top": [], "text": "", "cached": None, "finish": None, "num_output": 0,
                             "req": req, "deltas": []})
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            r = out[o.request_id]
            r["tokens"] += o.new_token_ids
            r["deltas"].append(list(o.new_token_ids))
            r["top"] += [lp.top for lp in o.logprobs if lp is not None]
            r["text"] += o.new_text
            r["cached"], r["finish"], r["num_output"] = o.num_cached_tokens, o.finish_reason, o.num_output_tokens
        if integrity:
            engine.kv_manager.check_integrity()
        if check is not None:
            check(engine)
        steps += 1
        assert steps < 20_000, "no progress"
    return out


def max_logprob_diff(a: list, b: list) -> float:
    """Largest |Δ logprob| over matching top lists (token ids must agree in order)."""
    worst = 0.0
    for ta, tb in zip(a, b):
        assert [t for t, _ in ta] == [t for t, _ in tb]
        worst = max(worst, max((abs(x - y) for (_, x), (_, y) in zip(ta, tb)), default=0.0))
    return worst


def assert_same(a: dict, b: dict, tol: float = TOL, first_only: bool = False) -> None:
    """Same token ids; top logprobs (of the first token, or every token) within ``tol``."""
    assert a["tokens"] == b["tokens"]
    assert len(a["top"]) == len(b["top"]) > 0
    n = 1 if first_only else len(a["top"])
    assert max_logprob_diff(a["top"][:n], b["top"][:n]) < tol


def prefill_sizes(sizes: list[int]):
    """A ``drive`` check appending every step's prefill chunk sizes to ``sizes``."""
    return lambda e: sizes.extend(s.num_new_tokens for s in e.last_scheduler_output.scheduled if s.is_prefill)


def assert_idle(engine) -> None:
    kv = engine.kv_manager
    kv.check_integrity()
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_usable_blocks
    assert not engine.scheduler.requests and not engine.detokenizers


# ---- S1: chunked prefill is exact --------------------------------------------------------
S1_LEN, S1_NEW = 1500, 8
S1_POOL = 128 * 2**20  # 181 usable blocks: 1,508 tokens need 95
S1_CHUNKS = (16, 64, 511, 512, 513, 1024)


@pytest.fixture(scope="module")
def s1_prompt() -> list[int]:
    return rand_ids(S1_LEN, seed=1)


@pytest.fixture(scope="module")
def s1_reference(make_engine, s1_prompt):
    """The unlimited-chunk run (whole prompt in one step), prefix cache on, then the same
    prompt again on the warm cache: (cold, warm) outputs."""
    eng = make_engine(kv_cache_memory=S1_POOL, max_num_batched_tokens=UNLIMITED, max_prefill_chunk=UNLIMITED,
                      prefix_cache_seed=11)
    sizes = []
    cold = drive(eng, {"cold": (s1_prompt, greedy(S1_NEW))}, check=prefill_sizes(sizes))["cold"]
    assert sizes == [S1_LEN]  # the whole prompt in one step
    warm = drive(eng, {"warm": (s1_prompt, greedy(S1_NEW))})["warm"]
    assert_idle(eng)
    return cold, warm


def test_s1_warm_prefix_cache_equals_cold(s1_reference):
    """The same 1,500-token prompt twice: the second is served from the cache for every full
    block but the one holding the last prompt token (1,488 tokens) and is exact."""
    cold, warm = s1_reference
    assert cold["cached"] == 0 and warm["cached"] == (S1_LEN - 1) // 16 * 16 == 1488
    assert len(cold["tokens"]) == S1_NEW
    assert_same(warm, cold)


@pytest.mark.parametrize("chunk", S1_CHUNKS)
def test_s1_chunked_prefill_is_exact_smollm2(make_engine, s1_prompt, s1_reference, chunk):
    """Case S1 (SmolLM2, CI size: 8 new tokens): a 1,500-token prompt prefilled in chunks of
    ``chunk`` tokens (token budget = chunk cap = ``chunk``) gives the unlimited run's 8 greedy
    tokens and its last-position logprobs (top 20) within 1e-4. The prefix cache alternates
    on/off by chunk size; where on, a warm rerun (1,488 cached tokens) is exact too."""
    cache_on = S1_CHUNKS.index(chunk) % 2 == 0
    eng = make_engine(kv_cache_memory=S1_POOL, max_num_batched_tokens=chunk, max_prefill_chunk=chunk,
                      enable_prefix_caching=cache_on, prefix_cache_seed=12)
    sizes = []
    out = drive(eng, {"r": (s1_prompt, greedy(S1_NEW))}, check=prefill_sizes(sizes))["r"]
    assert sizes == [min(chunk, S1_LEN - i) for i in range(0, S1_LEN, chunk)]  # really chunked
    cold, _ = s1_reference
    assert_same(out, cold, first_only=True)  # all 8 tokens, first token's logprobs
    if cache_on:
        warm = drive(eng, {"w": (s1_prompt, greedy(S1_NEW))})["w"]
        assert warm["cached"] == 1488
        assert_same(warm, cold, first_only=True)
    else:
        again = drive(eng, {"w": (s1_prompt[:40], greedy(2))})["w"]
        assert again["cached"] == 0  # cache off: never a hit
    assert_idle(eng)


# ---- S2: preemption is invisible ---------------------------------------------------------
S2_PROMPT, S2_NEW, S2_N, S2_BLOCKS = 100, 40, 6, 12  # issue 7's CI size of case S2 (full: 200, 150, 6, 24)


def s2_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    reqs = {}
    for i in range(S2_N):
        kw = {}
        if i == 1:
            kw["repetition_penalty"] = 1.3
        if i == 2:
            kw["frequency_penalty"] = 0.5
        reqs[f"s2-{i}"] = (rand_ids(S2_PROMPT, seed=200 + i), greedy(S2_NEW, logprobs=None, **kw))
    return reqs


def test_s2_preemption_is_invisible(make_engine):
    """Case S2 at issue 7's CI size: a pool of 12 blocks, 6 concurrent greedy requests (100 prompt
    tokens, 40 new, ignore_eos),
    one with repetition_penalty 1.3, one with frequency_penalty 0.5: at least one preemption
    (counted per request and in total), every output equals its large-pool output (181
    blocks: no preemption), no token streamed twice (one token per output; the streamed
    deltas, concatenated, are exactly the request's output tokens), completion tokens ==
    max_tokens; integrity every step.

    The pool holds one request near its end (9 blocks at 140 tokens); 64-token steps let a
    second one in on its first chunk, and growing then preempts. Set the constants to 200, 150,
    6, 24 for the full case."""
    small = make_engine(kv_cache_memory=smol_pool(S2_BLOCKS), max_num_batched_tokens=64)
    assert small.kv_manager.num_usable_blocks == S2_BLOCKS
    got = drive(small, s2_requests(), integrity=True)
    assert small.scheduler.num_preemptions >= 1
    assert small.scheduler.num_preemptions == sum(r["req"].num_preemptions for r in got.values())
    assert_idle(small)

    large = make_engine(kv_cache_memory=S1_POOL)
    want = drive(large, s2_requests())
    assert large.scheduler.num_preemptions == 0
    for rid, r in got.items():
        assert all(len(d) == 1 for d in r["deltas"]), rid  # one token per output, never a replay
        assert r["tokens"] == r["req"].output_token_ids == want[rid]["tokens"], rid
        assert len(r["tokens"]) == r["num_output"] == S2_NEW and r["finish"] == "length", rid
        assert r["text"] == want[rid]["text"], rid


# ---- S3: n > 1 under pressure ------------------------------------------------------------
S3_NEW, S3_OTHER_NEW = 48, 40  # the case says 120 new tokens: see the test


def s3_run(engine) -> tuple[dict[str, dict], list[str]]:
    """Two greedy requests (40-token prompts) start running, then n=4 (temperature 0.8, seed 11,
    100-token prompt, S3_NEW new tokens) joins; returns the outputs and the siblings' ids."""
    others = {f"o{i}": (rand_ids(40, seed=300 + i), greedy(S3_OTHER_NEW, logprobs=None)) for i in range(2)}
    for rid, (p, sp) in others.items():
        engine.add_request(p, sp, request_id=rid)
    early = drive_steps(engine, 2)
    assert {s.request_id for s in engine.last_scheduler_output.scheduled} == set(others)
    sp = SamplingParams(max_tokens=S3_NEW, temperature=0.8, seed=11, ignore_eos=True)
    ids = engine.add_parallel_request(rand_ids(100, seed=310), sp, [f"n{i}" for i in range(4)])
    out = drive(engine, integrity=True)
    for rid, toks in early.items():
        out[rid]["tokens"] = toks + out[rid]["tokens"]
    return out, ids


def drive_steps(engine, n: int) -> dict[str, list[int]]:
    toks: dict[str, list[int]] = {}
    for _ in range(n):
        for o in engine.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    return toks


def test_s3_parallel_sampling_under_pressure(make_engine):
    """Case S3: a pool of 16 blocks, n=4, temperature 0.8, seed 11, 100-token prompt, two other
    requests running: siblings are scheduled and preempted individually, yet 4 different
    choices of S3_NEW tokens come back, the same 4 texts as on a large pool (no preemption
    there); the other two equal their large-pool outputs; zero live blocks afterwards.

    CI size: 48 new tokens instead of the case's 120 (each sibling peaks at 10 blocks instead
    of 14; the 4 still need 6 shared + 4 x 4 own blocks > 16, so they are preempted). The
    siblings mostly run one after the other; 120 tokens took ~170 s on a loaded 1-thread
    machine. Set S3_NEW = 120 for the full case."""
    small = make_engine(kv_cache_memory=smol_pool(16))
    assert small.kv_manager.num_usable_blocks == 16
    got, ids = s3_run(small)
    sib_preempted = [got[i]["req"].num_preemptions for i in ids]
    assert small.scheduler.num_preemptions >= 1 and sum(sib_preempted) >= 1
    assert_idle(small)

    large = make_engine()
    want, _ = s3_run(large)
    assert large.scheduler.num_preemptions == 0
    for rid in ids:
        assert len(got[rid]["tokens"]) == S3_NEW and got[rid]["finish"] == "length", rid
        assert got[rid]["tokens"] == want[rid]["tokens"] and got[rid]["text"] == want[rid]["text"], rid
    assert len({tuple(got[i]["tokens"]) for i in ids}) == 4  # 4 different choices
    for rid in ("o0", "o1"):
        assert got[rid]["tokens"] == want[rid]["tokens"] and len(got[rid]["tokens"]) == S3_OTHER_NEW


# ---- S4: batch invariance ----------------------------------------------------------------
def test_s4_batch_invariance(make_engine):
    """Case S4: 8 copies of one greedy 48-token prompt sent together with 8 unrelated prompts
    of random lengths (10-300 tokens, some sampled at temperature 0.7), token budget 256, so
    some prefill (in chunks) while others decode, and copies admitted later hit the prefix
    cache: the 8 copies are identical to each other and to a solo run on a fresh engine: the
    same 16 tokens (exact), top logprobs within 1e-4 (CPU matmuls of other batch shapes round
    differently: ~2e-5 seen)."""
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(10, 301, (8,), generator=g).tolist()
    prompt = rand_ids(48, seed=400)
    reqs = {}
    for i in range(8):
        sampled = SamplingParams(max_tokens=16, temperature=0.7, seed=i, ignore_eos=True)
        sp = greedy(16, logprobs=5) if i % 2 else sampled
        reqs[f"u{i}"] = (rand_ids(lengths[i], seed=410 + i), sp)
        reqs[f"c{i}"] = (prompt, greedy(16, logprobs=5))
    eng = make_engine(max_num_batched_tokens=256)
    mixed, batch_sizes = [], set()

    def watch(e):
        so = e.last_scheduler_output
        copies = [s for s in so.scheduled if s.request_id.startswith("c")]
        if so.num_prefills and any(not s.is_prefill for s in copies):
            mixed.append(so.num_prefills)
        if copies:
            batch_sizes.add(len(so.scheduled))

    got = drive(eng, reqs, check=watch, integrity=True)
    assert mixed, "no copy decoded in a step with a prefill"
    assert len(batch_sizes) > 1
    solo = drive(make_engine(), {"solo": (prompt, greedy(16, logprobs=5))})["solo"]
    for i in range(8):
        assert_same(got[f"c{i}"], solo)
    assert {got[f"c{i}"]["cached"] for i in range(8)} >= {0, 32}  # cold and cache-served copies alike
    assert_idle(eng)


# ---- decodes flow while a long prompt is chunked ------------------------------------------
def test_decodes_scheduled_every_step_while_long_prompt_is_chunked(make_engine):
    """One request decoding; a 1,000-token prompt arrives with a token budget of 64: every
    step until the long prompt is computed schedules the decode first (1 token) and a chunk
    of at most 63 prompt tokens, within the budget; the decoding request's output equals its
    solo run (the chunked prompt's exactness is case S1)."""
    eng = make_engine(max_num_batched_tokens=64)
    short, long_ = rand_ids(20, seed=500), rand_ids(1000, seed=501)
    eng.add_request(short, greedy(40, logprobs=None), request_id="d")
    streamed = drive_steps(eng, 2)  # prefill + one decode
    eng.add_request(long_, greedy(2, logprobs=None), request_id="long")
    long_req = eng.scheduler.requests["long"]
    steps = 0
    while long_req.num_computed_tokens < 1000:
        for rid, t in drive_steps(eng, 1).items():
            streamed.setdefault(rid, []).extend(t)
        so = eng.last_scheduler_output
        assert [s.request_id for s in so.scheduled] == ["d", "long"]
        d, chunk = so.scheduled
        assert d.num_new_tokens == 1 and not d.is_prefill and d.sample
        assert chunk.is_prefill and 1 <= chunk.num_new_tokens <= 63
        assert so.total_num_scheduled_tokens <= 64
        steps += 1
    assert steps == -(-1000 // 63)
    rest = drive(eng)
    for rid, r in rest.items():
        streamed.setdefault(rid, []).extend(r["tokens"])
    assert len(streamed["long"]) == 2
    solo = drive(make_engine(), {"d": (short, greedy(40, logprobs=None))})["d"]["tokens"]
    assert streamed["d"] == solo  # decoding beside 16 prefill chunks changed nothing


# ---- up-front rejection ------------------------------------------------------------------
def test_rejects_request_that_fits_the_context_but_not_the_pool(make_engine):
    """A 300-token prompt + max_tokens 200 fits --max-model-len (8,192) but needs 32 blocks of
    a 24-block pool: add_request raises LlmdError naming the blocks, leaves no state behind,
    and the engine keeps serving; 300 + 84 (exactly 24 blocks) is accepted."""
    eng = make_engine(kv_cache_memory=smol_pool(24))
    assert eng.max_model_len == 8192
    prompt = rand_ids(300, seed=600)
    with pytest.raises(LlmdError, match=r"needs 32 KV blocks \(500 tokens.*only 24") as e:
        eng.add_request(prompt, greedy(200, logprobs=None), request_id="big")
    assert "kv-cache-memory" in str(e.value)
    assert not eng.scheduler.requests and not eng.scheduler.waiting and not eng.detokenizers
    eng.add_request(prompt, greedy(84, logprobs=None), request_id="big")  # 384 tokens: exactly 24 blocks
    assert eng.abort("big")
    out = drive(eng, {"small": (prompt[:40], greedy(2, logprobs=None))})["small"]
    assert len(out["tokens"]) == 2 and out["finish"] == "length"
    assert_idle(eng)
