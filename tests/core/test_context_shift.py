"""Context shift (``--context-overflow shift``, :mod:`llmd.daemon.core.context_shift`) through the
engine: a tiny random float32 Llama (blocks of 16, a 64-token context) for the bookkeeping, and
Gemma 3 270M with a 1,024-token context (window 512) for the re-rotation of both layer kinds.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_scheduling import drive, greedy
from tiny_engine import tiny_engine

from llmd.daemon.core.errors import RequestError
from llmd.daemon.core.request import SamplingParams

CTX = 64
PROMPT = "You are terse. Tell me about the sea"  # 36 byte tokens


@pytest.fixture(scope="module")
def shift_engine(tmp_path_factory):
    def make(**kw):
        kw = {"max_model_len": CTX, "context_overflow": "shift", "keep": 10, **kw}
        return tiny_engine(tmp_path_factory.mktemp("shift") / "t.gguf", **kw)
    return make


def _run(engine, requests, check=None):
    return drive(engine, {rid: (engine.input_processor.tokenize(p), sp) for rid, (p, sp) in requests.items()},
                 check=check, integrity=True)


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8_e4m3", "int4"])
def test_shift_generates_past_the_context_and_frees_blocks(shift_engine, kv):
    """Every KV dtype (int8 with its default hadamard rotation, int4 KIVI without): 120 tokens
    from a 36-token prompt in a 64-token context: finish_reason length at
    max_tokens (not at the context), the usage counts the prompt as sent and every generated
    token, each shift frees a whole block (keep 10 → one block kept, 16 tokens dropped), the
    integrity check holds after every step (int4: its residual slots too) and the pool, and every
    residual slot, is free at the end."""
    eng = shift_engine(kv_cache_dtype=kv)
    held = []

    def check(e):
        if e.scheduler.requests:
            held.append(e.kv_manager.num_blocks_held("a"))
    out = _run(eng, {"a": (PROMPT, greedy(120, logprobs=None))}, check)["a"]
    assert out["finish"] == "length" and len(out["tokens"]) == 120 and out["num_output"] == 120
    assert out["req"].total_prompt_tokens == 36
    assert eng.scheduler.num_context_shifts == (36 + 120 - CTX) // 16 + 1 == 6
    assert eng.make_stats().to_dict("m", 0.0)["scheduler"]["context_shifts"] == 6  # /v1/stats, llmd status
    assert max(held) == CTX // 16 and min(held[5:]) >= 3  # a 64-token context never holds more than 4
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_usable_blocks
    _assert_residual_free(eng)


def _assert_residual_free(eng):
    kv = eng.kv_manager
    assert not kv.req_residual and len(kv.free_residual_slots) == kv.num_residual_slots


def test_preempted_shifted_request_recomputes_its_shorter_context(shift_engine):
    """A request preempted after two shifts resumes by recomputing the context it has now (its
    kept head served from the prefix cache) and still makes all its tokens; no block leaks."""
    eng = shift_engine()
    eng.add_request(PROMPT, greedy(100, logprobs=None), request_id="p")
    n, preempted = 0, False
    while eng.has_unfinished_requests():
        n += len([o for o in eng.step() if o.new_token_ids])
        req = eng.scheduler.requests.get("p")
        if req is not None and req.num_context_shifts == 2 and not preempted:
            eng.scheduler._preempt(req)
            preempted = True
        eng.kv_manager.check_integrity()
    assert preempted and n == 100
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_usable_blocks


def test_stop_mode_is_unchanged(shift_engine):
    """--context-overflow stop: prompt + max_tokens beyond the context is refused naming
    max_tokens; a request may still ask for shift itself (its override)."""
    eng = shift_engine(context_overflow="stop")
    with pytest.raises(RequestError) as e:
        eng.add_request(PROMPT, greedy(100, logprobs=None))
    assert e.value.param == "max_tokens"
    out = _run(eng, {"b": (PROMPT, greedy(100, logprobs=None, context_overflow="shift"))})["b"]
    assert len(out["tokens"]) == 100 and eng.scheduler.num_context_shifts > 0


def test_shifted_output_does_not_depend_on_the_batch(shift_engine):
    """The shifting request gives the same tokens alone and next to two others (one of them
    shifting too, with another keep)."""
    alone = _run(shift_engine(), {"a": (PROMPT, greedy(64, logprobs=5))})["a"]
    eng = shift_engine()
    both = _run(eng, {"x": ("Other words, other tokens " * 2, greedy(40, logprobs=5, n_keep=0)),
                      "a": (PROMPT, greedy(64, logprobs=5)), "y": ("short", greedy(5, logprobs=5))})
    assert both["a"]["tokens"] == alone["tokens"]
    assert max(abs(a - b) for ta, tb in zip(alone["top"], both["a"]["top"]) for (_, a), (_, b) in zip(ta, tb)) < 1e-4


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_shift_never_serves_shifted_blocks_from_the_prefix_cache(shift_engine, kv):
    """After a long shifted request, the same prompt (stop mode, 20 tokens) on the warm cache
    equals a fresh engine's: the cache only serves blocks computed without a shift (int4: its
    full, quantized blocks; no residual slot stays held)."""
    eng = shift_engine(kv_cache_dtype=kv)
    _run(eng, {"a": (PROMPT, greedy(100, logprobs=None))})
    warm = _run(eng, {"w": (PROMPT, greedy(20, context_overflow="stop"))})["w"]
    cold = _run(shift_engine(enable_prefix_caching=False, kv_cache_dtype=kv), {"c": (PROMPT, greedy(20))})["c"]
    assert warm["cached"] == 32 and warm["tokens"] == cold["tokens"]
    _assert_residual_free(eng)


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_parallel_siblings_shift_their_shared_blocks_by_copy(shift_engine, kv):
    """n = 3 sampled siblings share the prompt's blocks; each shift copies a shared block before
    re-rotating it, so every sibling equals the same seed run alone (sibling 0 of a lone request
    draws as sibling 0 of the group), and no block leaks. int4: each shift also moves an open
    block of 15 tokens, whose K each sibling holds in its own residual slot (copied at the fork),
    and every slot is free at the end (48 tokens, two shifts each, to keep it cheap)."""
    new = 80 if kv == "auto" else 48
    eng = shift_engine(kv_cache_dtype=kv)
    sp = SamplingParams(max_tokens=new, temperature=0.8, seed=7, ignore_eos=True)
    ids = eng.add_parallel_request(PROMPT, sp, ["p0", "p1", "p2"])
    toks = {i: [] for i in ids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
        eng.kv_manager.check_integrity()
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_usable_blocks
    _assert_residual_free(eng)
    assert eng.scheduler.num_context_shifts >= 6  # each sibling shifts at least twice
    alone = _run(shift_engine(kv_cache_dtype=kv),
                 {"s": (PROMPT, SamplingParams(max_tokens=new, temperature=0.8, seed=7, ignore_eos=True))})["s"]
    assert toks["p0"] == alone["tokens"] and all(len(t) == new for t in toks.values())
    assert len({tuple(t) for t in toks.values()}) == 3


def test_int4_shift_rotates_the_open_blocks_residual(shift_engine):
    """int4 (KIVI), 64-token context, keep 10, the cpu fast path: a shift happens when the newest token (position 63)
    would not fit, so the last block moved is open, with 15 tokens (48..62, then 32..46) whose K
    lives in the request's 16-bit residual slot, not in its block. After the step that applies
    the shift, those 15 rows equal the float64 rotation by −Δ of what the slot held, to the
    residual's float16 rounding, in every cache tensor. Fails if the residual is not rotated
    (the rows would still hold the old keys)."""
    from llmd.kernels.kv_shift import rope_shift_tables

    eng = shift_engine(kv_cache_dtype="int4", attention_backend="cpu")  # the CPU default (the others: torch)
    runner, bs = eng.runner, eng.config.block_size
    snap: dict = {}
    checked, worst = 0, 0.0

    def check(e):
        nonlocal checked, worst
        for op in e.last_scheduler_output.residuals_to_shift:  # applied in this step
            for layer, cache in enumerate(runner.layer_caches):
                old, n = snap.pop((layer, op.slot))
                cos, sin = (t.double() for t in rope_shift_tables(op.delta, cache.head_dim,
                                                                   eng.model_config.layer_rope_theta(layer), "cpu"))
                want = old * cos + old.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin
                got = cache.residual[op.slot, :n].double()
                worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
                checked += 1
        assert not snap
        for rid, op in e.scheduler.pending_shifts:  # planned in this step: snapshot the open rows
            if not hasattr(op, "slot"):
                continue
            n = e.scheduler.requests[rid].num_computed_tokens % bs
            assert n == 15 and e.kv_manager.residual_slots(rid) == [op.slot]
            for layer, cache in enumerate(runner.layer_caches):
                snap[(layer, op.slot)] = (cache.residual[op.slot, :n].double().clone(), n)

    out = _run(eng, {"a": (PROMPT, greedy(60, logprobs=None))}, check)["a"]
    assert len(out["tokens"]) == 60 and eng.scheduler.num_context_shifts == 2
    assert checked == eng.scheduler.num_context_shifts * len(runner.layer_caches) and worst < 2.0**-10
    _assert_residual_free(eng)


def test_keep_covering_the_context_is_refused_unless_it_fits(shift_engine):
    """n_keep -1 (the whole prompt) with a 60-token prompt leaves nothing to discard in a 64-token
    context of 16-token blocks: when prompt + max_tokens passes the context it is a RequestError
    naming n_keep, as an explicit n_keep of 60 is (it would never shift); within the context it
    runs, and ends with finish_reason length."""
    eng = shift_engine()
    ids = eng.input_processor.tokenize("z" * 60)
    assert len(ids) == 60
    with pytest.raises(RequestError) as e:
        eng.add_request(ids, greedy(30, logprobs=None, n_keep=-1))
    assert e.value.param == "n_keep" and "whole prompt (60 tokens)" in str(e.value)
    assert "max_tokens <= 4" in str(e.value)
    out = _run(eng, {"k": ("z" * 60, greedy(CTX - 60, logprobs=None, n_keep=-1))})["k"]
    assert out["finish"] == "length" and len(out["tokens"]) == CTX - 60
    out = _run(eng, {"s": ("z" * 20, greedy(60, logprobs=None, n_keep=-1))})["s"]  # 20 <= 32: it shifts
    assert len(out["tokens"]) == 60 and eng.scheduler.num_context_shifts >= 1


def test_a_keep_that_leaves_nothing_to_discard_is_refused(shift_engine):
    """In a 64-token context with blocks of 16, n_keep above 32 can never shift: a request's is a
    RequestError naming n_keep, the daemon's --keep a one-line LlmdError at start-up."""
    from llmd.daemon.core.errors import LlmdError

    eng = shift_engine()
    with pytest.raises(RequestError) as e:
        eng.add_request(PROMPT, greedy(100, logprobs=None, n_keep=33))
    assert e.value.param == "n_keep" and "at most 32" in str(e.value)
    eng.add_request(PROMPT, greedy(4, logprobs=None, n_keep=32))
    with pytest.raises(LlmdError, match="--keep 48 .* at most 32"):
        shift_engine(keep=48)


def test_keep_0_still_keeps_the_attention_sink_block(shift_engine):
    """n_keep 0 keeps the first block (the attention sink): after every shift of a 36-token
    prompt + 60 tokens in a 64-token context the sequence still starts with the prompt's first 16
    tokens, and the blocks after it were dropped. In a 32-token context (no block to discard
    after a sink block) n_keep 0 drops from the start instead of stopping at the context."""
    eng = shift_engine()
    ids = eng.input_processor.tokenize(PROMPT)
    heads = []

    def check(e):
        for r in e.scheduler.requests.values():
            if r.num_context_shifts:
                heads.append(list(r.all_token_ids[:16]))
    out = drive(eng, {"a": (ids, greedy(60, logprobs=None, n_keep=0))}, check=check, integrity=True)["a"]
    assert out["req"].num_context_shifts >= 2 and len(out["tokens"]) == 60
    assert heads and all(h == ids[:16] for h in heads)
    assert out["req"].num_shifted_prompt_tokens == 20  # the prompt's tokens 16-35 went, 0-15 stayed
    small = shift_engine(max_model_len=32, keep=0)
    tiny = drive(small, {"t": (ids[:8], greedy(40, logprobs=None))}, integrity=True)["t"]
    assert len(tiny["tokens"]) == 40 and tiny["req"].num_context_shifts > 0 and tiny["req"].all_token_ids[:8] != ids[:8]


def test_truncate_prompt_tokens_keeps_the_end(shift_engine):
    """A 100-token prompt in a 64-token context is a 400 naming the prompt unless
    truncate_prompt_tokens opts in: then it equals sending its last k tokens."""
    eng = shift_engine(context_overflow="stop")
    long = "abcdefghij" * 10
    with pytest.raises(RequestError):
        eng.add_request(long, greedy(4))
    cut = _run(eng, {"t": (long, greedy(4, truncate_prompt_tokens=40))})["t"]
    tail = _run(eng, {"u": (long[-40:], greedy(4))})["u"]
    assert cut["tokens"] == tail["tokens"] and cut["req"].total_prompt_tokens == 40
    with pytest.raises(RequestError) as e:
        eng.add_request(long, greedy(4, truncate_prompt_tokens=CTX))
    assert e.value.param == "truncate_prompt_tokens"


# ---- Gemma 3: sliding-window and global layers move their keys with their own RoPE base ----
G_CTX, G_KEEP, G_PROMPT, G_NEW = 1024, 32, 1016, 12


def _gemma_run(make_gemma_engine, batched: bool) -> tuple[list[int], dict, float]:
    """One shifting request (plus a short one when ``batched``): its tokens, the RoPE bases of
    the layers whose moved keys were checked (base -> layers), the largest relative error."""
    from test_engine_windows import gemma_ids

    from llmd.kernels.kv_shift import rope_shift_tables

    eng = make_gemma_engine(max_model_len=G_CTX, context_overflow="shift", keep=G_KEEP, prefix_cache_seed=3)
    runner, cfg = eng.runner, eng.model_config
    checked: dict[float, int] = {}
    worst = 0.0
    snap: dict = {}

    def check(e):
        nonlocal worst
        for op in e.last_scheduler_output.blocks_to_shift:  # applied in this step: compare to the snapshot
            for layer, g in enumerate(runner.layer_group):
                if g != op.group or (layer, op.src) not in snap:
                    continue
                theta = cfg.layer_rope_theta(layer)
                cos, sin = (t.double() for t in rope_shift_tables(op.delta, cfg.head_dim, theta, "cpu"))
                old = snap[(layer, op.src)]
                want = old * cos + old.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin
                got = runner.layer_caches[layer].data[0, op.dst].double()
                worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
                checked[theta] = checked.get(theta, 0) + 1
        snap.clear()
        for rid, op in e.scheduler.pending_shifts:  # planned in this step: snapshot the sources
            table = e.kv_manager.get_block_table(rid, op.group)
            if op.dst == table[-1]:
                continue  # the newest, partly filled block gets a new token next step
            for layer, g in enumerate(runner.layer_group):
                if g == op.group:
                    snap[(layer, op.src)] = runner.layer_caches[layer].data[0, op.src].double().clone()

    reqs = {"s": (gemma_ids(G_PROMPT, seed=5), greedy(G_NEW, logprobs=None))}
    if batched:
        reqs["o"] = (gemma_ids(40, seed=6), greedy(12, logprobs=None))
    out = drive(eng, reqs, check=check, integrity=True)
    assert eng.scheduler.num_context_shifts == 1
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_usable_blocks
    return out["s"]["tokens"], checked, worst


@pytest.mark.slow
def test_gemma3_shift_rerotates_both_layer_kinds(make_gemma_engine):
    """Gemma 3 270M, float32, context 1,024 (window 512), keep 32: a 1,016-token prompt next to
    a short request shifts once at 1,024 tokens (30 blocks = 480 positions dropped). Every moved
    full block's keys, per layer, equal the float64 rotation by −480 positions with that layer's
    base (10,000 on sliding-window layers, 1e6 on global ones) of what the block held, to 1e-5 of
    the keys' magnitude; integrity holds after every step and the pool is whole after. (That the
    output does not depend on the batch is shown on the tiny model above.)"""
    tokens, checked, worst = _gemma_run(make_gemma_engine, batched=True)
    assert len(tokens) == G_NEW
    assert set(checked) == {10_000.0, 1_000_000.0} and worst < 1e-5


def test_runner_reads_every_shift_source_before_writing(shift_engine):
    """Two requests shifting in one step: block 2, released by the first (moved to 5 by 16
    positions), is the second's fresh block (block 3 moved into it by 32). The runner's one pass
    equals the ops applied one by one in their order, in every layer."""
    from llmd.daemon.core.outputs import BlockShift

    def filled():
        eng = shift_engine()
        torch.manual_seed(3)
        for c in eng.runner.caches:
            c.data.copy_(torch.randn_like(c.data))
        return eng.runner

    ops = [BlockShift(2, 5, 0, 16), BlockShift(3, 2, 0, 32)]
    together, apart = filled(), filled()
    together.shift_blocks(list(reversed(ops)) + [BlockShift(4, 4, 0, 48)])
    for op in [*ops, BlockShift(4, 4, 0, 48)]:
        apart.shift_blocks([op])
    for a, b in zip(together.caches, apart.caches):
        assert torch.equal(a.data[:, [2, 4, 5]], b.data[:, [2, 4, 5]])
