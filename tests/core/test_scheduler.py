"""Tests for llmd.daemon.core.scheduler: continuous batching, chunked prefill, admission, stops, aborts.

No model: a deterministic stub runner plays the GPU. It keeps a paged "KV cache" (a token per
(block id, slot)), writes each step's scheduled tokens through the step's block tables, reads a
request's whole history back through its block table, and samples
``hash(history) % vocab + 10``. Any lost, duplicated or reordered token, a wrong position or two
requests sharing a block changes every later token, so comparing outputs with a request run
alone catches it.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmd.daemon.core.outputs import SchedulerOutput
from llmd.daemon.core.request import Request, RequestStatus, SamplingParams
from llmd.daemon.core.scheduler import Scheduler
from llmd.daemon.kv import KVCacheManager

BIG = 10**9


# ---- stub model ---------------------------------------------------------------------
def next_token(history: tuple[int, ...], vocab: int = 1000) -> int:
    return hash(history) % vocab + 10


def reference(prompt, max_tokens, *, eos=(), stop_ids=(), ignore_eos=False, max_model_len=BIG, vocab=1000):
    """What the stub generates for one request, without any scheduler: (tokens, finish_reason)."""
    toks, out = list(prompt), []
    while True:
        t = next_token(tuple(toks), vocab)
        toks.append(t)
        out.append(t)
        if (not ignore_eos and t in eos) or t in stop_ids:
            return out, "stop"
        if len(out) >= max_tokens or len(toks) >= max_model_len:
            return out, "length"


class StubRunner:
    """Executes a SchedulerOutput against a paged token store; returns request_id -> sampled token."""

    def __init__(self, block_size: int, vocab: int = 1000):
        self.bs = block_size
        self.vocab = vocab
        self.slots: dict[tuple[int, int], int] = {}
        self.pos: dict[str, int] = {}  # tokens the runner has computed per request
        self.restarted: set[str] = set()  # preempted requests (the harness tells the runner)

    def _slot(self, table, p):
        return (table[p // self.bs], p % self.bs)

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), f"request scheduled twice in one step: {ids}"
        for s in out.scheduled:  # write every K/V first (one forward pass) ...
            assert s.num_new_tokens >= 1, s
            if s.request_id in self.restarted:  # preempted: recomputes from the start
                self.restarted.discard(s.request_id)
                assert s.num_computed_tokens == 0, s
            else:
                assert s.num_computed_tokens == self.pos.get(s.request_id, 0), (
                    f"{s.request_id}: scheduled from position {s.num_computed_tokens}, "
                    f"runner has {self.pos.get(s.request_id, 0)}"
                )
            end = s.num_computed_tokens + s.num_new_tokens
            assert len(s.block_table) * self.bs >= end, f"{s.request_id}: block table too short"
            assert 0 not in s.block_table, "null block handed to a request"
            for i, t in enumerate(s.token_ids):
                self.slots[self._slot(s.block_table, s.num_computed_tokens + i)] = t
            self.pos[s.request_id] = end
        sampled = {}
        for s in out.scheduled:  # ... then read histories and sample
            if s.sample:
                end = s.num_computed_tokens + s.num_new_tokens
                hist = tuple(self.slots[self._slot(s.block_table, p)] for p in range(end))
                sampled[s.request_id] = next_token(hist, self.vocab)
        return sampled


def make_req(rid, prompt, max_tokens, *, eos=(), stop_ids=(), ignore_eos=False):
    sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop_ids), ignore_eos=ignore_eos, seed=0)
    return Request(rid, list(prompt), sp, eos_token_ids=frozenset(eos))


def prompt_of(n, salt=0):
    return [(7 * i + 13 * salt) % 997 + 1 for i in range(n)]


def blocks_for(n_tokens, bs):
    return -(-n_tokens // bs)


class Harness:
    """Scheduler + KV manager + stub runner, with per-step invariant checks."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=BIG, vocab=1000,
                 scheduling_policy="fcfs"):
        self.kv = KVCacheManager(num_blocks, block_size)
        self.sched = Scheduler(self.kv, max_num_seqs, budget, max_model_len, scheduling_policy=scheduling_policy)
        self.runner = StubRunner(block_size, vocab)
        self.outputs: list[SchedulerOutput] = []
        self.admission_order: list[str] = []
        self.preemptions: list[str] = []
        self.all_reqs: dict[str, Request] = {}

    def add(self, req: Request) -> Request:
        self.sched.add_request(req)
        self.all_reqs[req.request_id] = req
        return req

    def check_invariants(self):
        s, kv = self.sched, self.kv
        kv.check_integrity()
        assert len(s.running) <= s.max_num_seqs
        tables = [set(kv.get_block_table(r.request_id)) for r in s.running]
        assert sum(map(len, tables)) == len(set().union(*tables)), "a block is in two block tables"
        assert set(kv.request_ids()) == {r.request_id for r in s.running}, "blocks held by a non-running request"
        # blocks are allocated as tokens are computed
        for r in s.running:
            assert kv.num_blocks_held(r.request_id) == blocks_for(r.num_computed_tokens, kv.block_size)
            assert r.status == RequestStatus.RUNNING
        for r in s.waiting:
            assert r.status == RequestStatus.WAITING and kv.num_blocks_held(r.request_id) == 0

    def schedule(self) -> SchedulerOutput:
        running_before = [r.request_id for r in self.sched.running]
        preempt_before = {rid: r.num_preemptions for rid, r in self.sched.requests.items()}
        out = self.sched.schedule()
        ids = [x.request_id for x in out.scheduled]
        for rid, r in self.sched.requests.items():
            if r.num_preemptions > preempt_before.get(rid, 0):
                self.runner.restarted.add(rid)
                self.preemptions.append(rid)
        assert out.total_num_scheduled_tokens <= self.sched.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.max_num_seqs
        # running requests still running progress before any newcomer (unless the budget ran out)
        live = self.sched.requests
        still = [rid for rid in running_before if live.get(rid) and live[rid].status == RequestStatus.RUNNING]
        if out.total_num_scheduled_tokens < self.sched.max_num_batched_tokens:
            assert set(still) <= set(ids[: len(still)]), (running_before, ids)
        # decodes first: no decode (one new token past the prompt, sampled) after a chunk in batch
        # order; a resumed request recomputing its output in 1-token chunks is a chunk, not a decode
        kinds = [not (x.num_new_tokens == 1 and x.sample and not x.is_prefill)
                 for x in out.scheduled if x.request_id in still]
        assert kinds == sorted(kinds), f"decode scheduled after a chunk: {kinds}"
        for x in out.scheduled:
            req = self.sched.requests[x.request_id]
            assert x.token_ids == req.all_token_ids[x.num_computed_tokens : x.num_computed_tokens + x.num_new_tokens]
            assert x.sample == (x.num_computed_tokens + x.num_new_tokens == req.num_tokens)
            assert x.is_prefill == (x.num_computed_tokens < req.num_prompt_tokens)
        self.admission_order += [rid for rid in ids[len(still) :] if rid not in self.admission_order]
        self.outputs.append(out)
        return out

    def step(self, abort_mid: tuple[str, ...] = ()) -> tuple[SchedulerOutput, list[Request]]:
        out = self.schedule()
        sampled = self.runner.execute(out)
        for rid in abort_mid:
            self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        finished = self.sched.update_from_output(out, sampled)
        for r in finished:
            assert r.is_finished and self.kv.num_blocks_held(r.request_id) == 0
            assert r.request_id not in self.sched.requests
        self.check_invariants()
        return out, finished

    def run_to_completion(self, max_steps=10_000):
        n = 0
        while self.sched.has_unfinished_requests():
            self.step()
            n += 1
            assert n < max_steps, "scheduler made no progress"
        self.assert_drained()

    def assert_drained(self):
        assert not self.sched.has_unfinished_requests()
        assert self.kv.num_used_blocks == 0
        assert self.kv.request_ids() == []
        self.kv.check_integrity()


def alone(prompt, max_tokens, *, max_model_len=BIG, vocab=1000, **kw):
    """Run one request alone through the scheduler with a huge pool and budget."""
    h = Harness(num_blocks=257, block_size=16, max_num_seqs=1, budget=BIG, max_model_len=max_model_len, vocab=vocab)
    r = h.add(make_req("solo", prompt, max_tokens, **kw))
    h.run_to_completion()
    return r.output_token_ids, r.status.finish_reason


def sched_ids(out: SchedulerOutput):
    return [s.request_id for s in out.scheduled]


# ---- basic: stub + harness ----------------------------------------------------------
def test_alone_matches_reference():
    for n, m in [(1, 1), (5, 9), (33, 4)]:
        assert alone(prompt_of(n), m) == reference(prompt_of(n), m)


# ---- continuous batching ------------------------------------------------------------
def test_request_arriving_mid_decode_joins_next_step():
    h = Harness(budget=64)
    a = h.add(make_req("a", prompt_of(5, 1), 20))
    b = h.add(make_req("b", prompt_of(7, 2), 20))
    out, _ = h.step()
    assert sched_ids(out) == ["a", "b"] and out.num_prefills == 2
    h.step()
    h.step()
    c = h.add(make_req("c", prompt_of(6, 3), 5))
    out, _ = h.step()
    assert sched_ids(out) == ["a", "b", "c"]
    assert [s.is_prefill for s in out.scheduled] == [False, False, True]
    assert out.scheduled[2].num_computed_tokens == 0 and out.scheduled[2].num_new_tokens == 6
    h.run_to_completion()
    for r in (a, b, c):
        expected = reference(r.prompt_token_ids, r.sampling_params.max_tokens)
        assert (r.output_token_ids, r.status.finish_reason) == expected


def test_finished_request_slot_reused_next_step():
    # max_num_seqs=2: "c" waits for a slot and takes it in the step right after "a" finishes.
    h = Harness(max_num_seqs=2)
    a = h.add(make_req("a", prompt_of(4, 1), 3))
    h.add(make_req("b", prompt_of(4, 2), 10))
    c = h.add(make_req("c", prompt_of(4, 3), 4))
    finished_at = None
    for step in range(20):
        out, fin = h.step()
        if finished_at is None:
            assert "c" not in sched_ids(out)
            assert len(out.scheduled) <= 2
        if a in fin:
            finished_at = step
            break
    assert finished_at == 2  # 1 prefill + 2 decodes
    out, _ = h.step()
    assert sched_ids(out) == ["b", "c"]
    h.run_to_completion()
    assert c.output_token_ids == reference(c.prompt_token_ids, 4)[0]


def test_pool_runs_dry_preempts_the_latest_arrival():
    # The pool holds one request's peak: both start, "a" grows, "b" (the later one) is
    # preempted, resumes after "a" finishes, and both outputs are unchanged.
    bs = 4
    h = Harness(num_blocks=1 + 3, block_size=bs)
    a = h.add(make_req("a", prompt_of(6, 1), 5))  # 11 tokens -> 3 blocks
    b = h.add(make_req("b", prompt_of(3, 2), 9))  # 12 tokens -> 3 blocks
    out, _ = h.step()
    assert sched_ids(out) == ["a", "b"]  # blocks are allocated as tokens arrive: 2 + 1
    while "b" not in h.preemptions:
        h.step()
    assert b.num_preemptions >= 1 and a.num_preemptions == 0 and h.sched.num_preemptions >= 1
    assert b.status == RequestStatus.WAITING and h.kv.num_blocks_held("b") == 0
    h.run_to_completion()
    assert a.output_token_ids == reference(a.prompt_token_ids, 5)[0]
    assert b.output_token_ids == reference(b.prompt_token_ids, 9)[0]


# ---- token budget and chunked prefill -----------------------------------------------
def test_long_prompt_alone_is_chunked():
    h = Harness(num_blocks=64, block_size=4, budget=16)
    r = h.add(make_req("long", prompt_of(50), 3))
    chunks = []
    while r.num_computed_tokens < 50:
        out, _ = h.step()
        (s,) = out.scheduled
        chunks.append((s.num_computed_tokens, s.num_new_tokens, s.sample, s.is_prefill))
    assert chunks == [(0, 16, False, True), (16, 16, False, True), (32, 16, False, True), (48, 2, True, True)]
    assert r.num_output_tokens == 1
    h.run_to_completion()
    assert (r.output_token_ids, r.status.finish_reason) == reference(prompt_of(50), 3)


def test_decodes_continue_while_long_prompt_is_chunked():
    budget = 8
    h = Harness(num_blocks=128, block_size=4, budget=budget)
    d1 = h.add(make_req("d1", prompt_of(3, 1), 40))
    d2 = h.add(make_req("d2", prompt_of(4, 2), 40))
    h.step()  # both prefill (7 tokens <= 8)
    long = h.add(make_req("long", prompt_of(45, 3), 5))
    expect_start = 0
    steps = 0
    while long.num_computed_tokens < 45:
        out, _ = h.step()
        steps += 1
        assert out.total_num_scheduled_tokens <= budget
        assert sched_ids(out) == ["d1", "d2", "long"]
        assert [s.is_prefill for s in out.scheduled] == [False, False, True]
        assert [s.num_new_tokens for s in out.scheduled[:2]] == [1, 1]
        chunk = out.scheduled[2]
        assert chunk.num_computed_tokens == expect_start
        expect_start += chunk.num_new_tokens
        assert chunk.sample == (expect_start == 45)
        assert chunk.num_new_tokens == min(budget - 2, 45 - chunk.num_computed_tokens)
    assert steps == 8  # ceil(45 / 6)
    out, _ = h.step()
    assert [s.is_prefill for s in out.scheduled] == [False, False, False]
    h.run_to_completion()
    for r in (d1, d2, long):
        expected = reference(r.prompt_token_ids, r.sampling_params.max_tokens)
        assert (r.output_token_ids, r.status.finish_reason) == expected
    assert max(o.total_num_scheduled_tokens for o in h.outputs) <= budget


def test_budget_never_exceeded_with_many_requests():
    budget = 10
    h = Harness(num_blocks=200, block_size=4, budget=budget, max_num_seqs=6)
    reqs = [h.add(make_req(f"r{i}", prompt_of(3 + 5 * i, i), 4 + i)) for i in range(8)]
    h.run_to_completion()
    assert all(o.total_num_scheduled_tokens <= budget for o in h.outputs)
    assert any(o.total_num_scheduled_tokens == budget for o in h.outputs)
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens)[0]


# ---- max_num_seqs, FCFS, head-of-line blocking --------------------------------------
def test_max_num_seqs_and_fcfs():
    h = Harness(max_num_seqs=2, budget=BIG)
    lens = [5, 2, 8, 3, 1, 6]
    reqs = [h.add(make_req(f"r{i}", prompt_of(4, i), m)) for i, m in enumerate(lens)]
    while h.sched.has_unfinished_requests():
        out, _ = h.step()
        assert len(out.scheduled) <= 2 and len(h.sched.running) <= 2
    h.assert_drained()
    assert h.admission_order == [f"r{i}" for i in range(6)]
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens)[0]


def test_head_of_line_blocking():
    bs = 4
    h = Harness(num_blocks=1 + 4, block_size=bs, budget=BIG)
    a = h.add(make_req("a", prompt_of(11, 1), 5))  # prompt: 3 blocks, 16 tokens at most -> 4 blocks
    b = h.add(make_req("b", prompt_of(8, 2), 2))  # prompt: 2 blocks: does not fit next to a
    c = h.add(make_req("c", prompt_of(2, 3), 2))  # 1 block: would fit, but must wait behind b
    out, _ = h.step()
    assert sched_ids(out) == ["a"]
    while not a.is_finished:
        out, _ = h.step()
        assert sched_ids(out) == ["a"], "a later request overtook a blocked earlier one"
        assert [r.request_id for r in h.sched.waiting] == ["b", "c"]
    out, _ = h.step()
    assert sched_ids(out) == ["b", "c"]  # both fit now: 2 + 1 <= 4
    h.run_to_completion()
    assert h.admission_order == ["a", "b", "c"]
    for r in (a, b, c):
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens)[0]


# ---- admission reservation ----------------------------------------------------------
@pytest.mark.parametrize("prompt_len,max_tokens", [(1, 1), (4, 4), (5, 4), (3, 6), (9, 1), (30, 7)])
def test_blocks_are_allocated_as_tokens_arrive(prompt_len, max_tokens):
    bs = 4
    h = Harness(num_blocks=64, block_size=bs, budget=3)  # small budget: only a chunk is scheduled
    h.add(make_req("r", prompt_of(prompt_len), max_tokens))
    out = h.schedule()
    assert h.sched.peak_blocks(h.sched.requests["r"]) == blocks_for(prompt_len + max_tokens, bs)
    want = blocks_for(min(prompt_len, 3), bs)  # allocated: only what this step computes
    assert h.kv.num_blocks_held("r") == want == len(out.scheduled[0].block_table)
    assert h.kv.num_used_blocks == want
    h.sched.update_from_output(out, h.runner.execute(out))
    h.run_to_completion()


def test_request_that_can_never_fit_raises():
    bs = 4
    h = Harness(num_blocks=1 + 5, block_size=bs)
    h.add(make_req("fits", prompt_of(12), 8))  # exactly 20 tokens = 5 blocks: accepted
    with pytest.raises(ValueError) as ei:
        h.add(make_req("big", prompt_of(12), 9))  # 21 tokens -> 6 blocks > 5
    msg = str(ei.value)
    assert re.search(r"\b6\b", msg) and re.search(r"\b5\b", msg), msg
    assert "block" in msg.lower()
    assert "big" not in h.sched.requests and [r.request_id for r in h.sched.waiting] == ["fits"]
    h.run_to_completion()


# ---- stop conditions ----------------------------------------------------------------
def _eos_at(prompt, max_tokens, k):
    """A token the stub emits first at output index k (so it works as EOS there)."""
    out, _ = reference(prompt, max_tokens)
    for i in range(k, len(out)):
        if out[i] not in out[:i]:
            return i, out[i]
    raise AssertionError("no fresh token")


def test_stop_on_eos():
    p = prompt_of(6, 4)
    k, eos = _eos_at(p, 30, 3)
    h = Harness()
    r = h.add(make_req("r", p, 30, eos=[eos]))
    h.run_to_completion()
    assert r.status == RequestStatus.FINISHED_STOPPED and r.status.finish_reason == "stop"
    assert r.stop_reason == eos and r.output_token_ids[-1] == eos and r.num_output_tokens == k + 1
    assert (r.output_token_ids, "stop") == reference(p, 30, eos=[eos])


def test_ignore_eos_runs_to_max_tokens():
    p = prompt_of(6, 4)
    _, eos = _eos_at(p, 30, 3)
    h = Harness()
    r = h.add(make_req("r", p, 30, eos=[eos], ignore_eos=True))
    h.run_to_completion()
    assert r.status.finish_reason == "length" and r.num_output_tokens == 30
    assert r.output_token_ids == reference(p, 30)[0]


def test_stop_token_ids_even_with_ignore_eos():
    p = prompt_of(9, 5)
    k, tok = _eos_at(p, 30, 5)
    h = Harness()
    r = h.add(make_req("r", p, 30, stop_ids=[tok], ignore_eos=True))
    h.run_to_completion()
    assert r.status.finish_reason == "stop" and r.stop_reason == tok and r.num_output_tokens == k + 1


def test_max_tokens_finishes_with_length():
    h = Harness()
    r = h.add(make_req("r", prompt_of(5), 7))
    h.run_to_completion()
    assert r.status == RequestStatus.FINISHED_LENGTH and r.status.finish_reason == "length"
    assert r.num_output_tokens == 7 and r.stop_reason is None


def test_max_model_len_finishes_with_length():
    h = Harness(num_blocks=64, block_size=4, max_model_len=15)
    r = h.add(make_req("r", prompt_of(10), 100))
    h.run_to_completion()
    assert r.status.finish_reason == "length" and r.num_tokens == 15 and r.num_output_tokens == 5
    # the last sampled token is never computed, so no position >= max_model_len is used
    assert max(s.num_computed_tokens + s.num_new_tokens for o in h.outputs for s in o.scheduled) <= 15
    assert r.output_token_ids == reference(prompt_of(10), 100, max_model_len=15)[0]


def test_finished_requests_free_all_blocks():
    h = Harness(num_blocks=40, block_size=4, budget=16)
    for i in range(5):
        h.add(make_req(f"r{i}", prompt_of(3 + 4 * i, i), 2 + 3 * i))
    used = []
    while h.sched.has_unfinished_requests():
        h.step()
        used.append(h.kv.num_used_blocks)
        expect = sum(h.kv.num_blocks_held(r.request_id) for r in h.sched.running)
        assert h.kv.num_used_blocks == expect
    assert used[-1] == 0 and max(used) > 0
    h.assert_drained()


# ---- abort --------------------------------------------------------------------------
def test_abort_waiting_request():
    h = Harness(max_num_seqs=1)
    a = h.add(make_req("a", prompt_of(4, 1), 3))
    b = h.add(make_req("b", prompt_of(4, 2), 3))
    h.step()
    h.sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and b.status.finish_reason == "abort"
    assert "b" not in h.sched.requests and list(h.sched.waiting) == []
    h.sched.finish_request("b", RequestStatus.FINISHED_ABORTED)  # idempotent
    h.sched.finish_request("nope", RequestStatus.FINISHED_ABORTED)  # unknown id ignored
    h.check_invariants()
    h.run_to_completion()
    assert all("b" not in sched_ids(o) for o in h.outputs)
    assert a.output_token_ids == reference(a.prompt_token_ids, 3)[0]


def test_abort_running_request_frees_blocks_and_admits_next():
    h = Harness(num_blocks=1 + 4, block_size=4)
    a = h.add(make_req("a", prompt_of(13, 1), 3))  # prompt: 4 blocks, the whole pool
    b = h.add(make_req("b", prompt_of(2, 2), 3))
    h.step()
    h.step()
    assert h.kv.num_blocks_held("a") == 4 and [r.request_id for r in h.sched.waiting] == ["b"]
    n_out = a.num_output_tokens
    h.sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and h.kv.num_used_blocks == 0
    assert h.sched.running == []
    h.sched.finish_request("a", RequestStatus.FINISHED_ABORTED)  # idempotent
    h.check_invariants()
    assert a.num_output_tokens == n_out
    assert a.output_token_ids == reference(a.prompt_token_ids, 3)[0][:n_out]
    out, _ = h.step()
    assert sched_ids(out) == ["b"]
    h.run_to_completion()
    assert b.output_token_ids == reference(b.prompt_token_ids, 3)[0]


def test_abort_finished_request_is_noop():
    h = Harness()
    r = h.add(make_req("r", prompt_of(3), 2))
    h.run_to_completion()
    h.sched.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert r.status == RequestStatus.FINISHED_LENGTH
    h.assert_drained()


def test_abort_between_schedule_and_update():
    h = Harness(num_blocks=1 + 8, block_size=4, budget=BIG)
    a = h.add(make_req("a", prompt_of(5, 1), 10))  # 4 blocks at most
    b = h.add(make_req("b", prompt_of(5, 2), 10))
    h.step()
    h.step()
    c = h.add(make_req("c", prompt_of(5, 3), 3))
    # abort a decoding request and a request in the very step it is admitted, while the step runs
    out, fin = h.step(abort_mid=("a", "c"))
    assert sched_ids(out) == ["a", "b", "c"] and out.scheduled[2].is_prefill and fin == []
    assert a.status == RequestStatus.FINISHED_ABORTED and a.num_output_tokens == 2
    assert h.kv.num_blocks_held("a") == 0
    assert c.status == RequestStatus.FINISHED_ABORTED and c.num_computed_tokens == 0 and c.num_output_tokens == 0
    # abort a request that finishes in this very step: the abort wins, update skips it
    while b.num_output_tokens < 9:
        h.step()
    out, fin = h.step(abort_mid=("b",))
    assert fin == [] and b.status == RequestStatus.FINISHED_ABORTED and b.num_output_tokens == 9
    h.assert_drained()
    assert b.output_token_ids == reference(b.prompt_token_ids, 10)[0][:9]
    # the pool is fully reusable afterwards
    d = h.add(make_req("d", prompt_of(5, 4), 10))
    h.run_to_completion()
    assert d.output_token_ids == reference(d.prompt_token_ids, 10)[0]


# ---- randomized: batched output == output alone -------------------------------------
req_spec = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 24),
        "max_tokens": st.integers(1, 12),
        "arrival": st.integers(0, 12),
        "abort": st.one_of(st.none(), st.tuples(st.integers(0, 30), st.booleans())),  # (step, mid-step?)
        "ignore_eos": st.booleans(),
        "salt": st.integers(0, 10**6),
    }
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(req_spec, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 6),
    budget=st.integers(1, 12),
    max_num_seqs=st.integers(1, 4),
    max_model_len=st.sampled_from([BIG, 20, 28]),
)
def test_random_mixes_match_solo_runs(specs, block_size, extra_blocks, budget, max_num_seqs, max_model_len):
    vocab = 20  # small vocab: EOS (token 10) is hit now and then
    eos = (10,)
    need = [blocks_for(s["prompt_len"] + s["max_tokens"], block_size) for s in specs]
    h = Harness(
        num_blocks=1 + max(need) + extra_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        budget=budget,
        max_model_len=max_model_len,
        vocab=vocab,
    )
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    step = 0
    while True:
        for i, s in enumerate(specs):
            if s["arrival"] == step:
                rid = f"r{i}"
                n = min(s["prompt_len"], max_model_len - 1)  # the engine rejects prompt >= max_model_len
                prompt = [(s["salt"] * 31 + 17 * j) % 900 + 30 for j in range(n)]
                reqs[rid] = h.add(make_req(rid, prompt, s["max_tokens"], eos=eos, ignore_eos=s["ignore_eos"]))
        mid = []
        for i, s in enumerate(specs):
            rid = f"r{i}"
            if s["abort"] is not None and s["abort"][0] == step and rid in reqs:
                if s["abort"][1]:
                    mid.append(rid)
                else:
                    if rid in h.sched.requests:
                        aborted.add(rid)
                    h.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                    h.check_invariants()
        live_before_mid = {rid for rid in mid if rid in h.sched.requests}
        h.step(abort_mid=tuple(mid))
        aborted |= live_before_mid
        step += 1
        if step > 12 and not h.sched.has_unfinished_requests():
            break
        assert step < 2000, "no progress"
    h.assert_drained()
    assert len(reqs) == len(specs)
    # FCFS: admission order follows arrival order (ties by index) among admitted requests
    order = sorted(reqs, key=lambda rid: (specs[int(rid[1:])]["arrival"], int(rid[1:])))
    assert h.admission_order == [rid for rid in order if rid in h.admission_order]
    for rid, r in reqs.items():
        solo = alone(
            r.prompt_token_ids, r.sampling_params.max_tokens, max_model_len=max_model_len, vocab=vocab,
            eos=eos, ignore_eos=r.sampling_params.ignore_eos,
        )
        assert solo == reference(
            r.prompt_token_ids, r.sampling_params.max_tokens, eos=eos, ignore_eos=r.sampling_params.ignore_eos,
            max_model_len=max_model_len, vocab=vocab,
        )
        if rid in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.output_token_ids == solo[0][: r.num_output_tokens]
        else:
            assert (r.output_token_ids, r.status.finish_reason) == solo, rid
