"""Preemption by recompute, priorities, the bounded waiting queue and the prefill chunk cap,
on the scheduler with the stub runner of test_scheduler (next token = hash of the whole
history read back through the block tables, so a lost, duplicated or reordered token, or a
wrong recompute, changes every later token)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_scheduler import BIG, Harness, alone, blocks_for, make_req, prompt_of, sched_ids

from llmd.daemon.core.errors import QueueFullError, RequestError
from llmd.daemon.core.request import Request, RequestStatus, SamplingParams
from llmd.daemon.core.scheduler import Scheduler
from llmd.daemon.kv import KVCacheManager


def with_priority(req: Request, priority: int) -> Request:
    req.priority = priority
    return req


def test_preempted_request_resumes_exactly():
    """A tiny pool: the later request is preempted (counter +1 only when blocks were freed),
    resumes by recompute, and every output equals its solo run; no token is emitted twice."""
    h = Harness(num_blocks=1 + 6, block_size=4, budget=8)
    reqs = [h.add(make_req(f"r{i}", prompt_of(9, i), 12)) for i in range(3)]
    h.run_to_completion()
    assert h.sched.num_preemptions >= 1
    assert h.sched.num_preemptions == sum(r.num_preemptions for r in reqs) == len(h.preemptions)
    assert reqs[0].num_preemptions == 0  # the earliest arrival is never the victim
    for r in reqs:
        assert (r.output_token_ids, r.status.finish_reason) == alone(r.prompt_token_ids, 12)
        assert len(r.output_token_ids) == 12


def test_priority_orders_admission_and_preemption():
    """Under ``scheduling_policy="priority"``: lower priority value runs first (FCFS among
    equals); the largest value is preempted first and goes back to the front of its class."""
    h = Harness(num_blocks=1 + 8, block_size=4, budget=BIG, max_num_seqs=2, scheduling_policy="priority")
    low = h.add(with_priority(make_req("low", prompt_of(4, 1), 3), 5))
    hi1 = h.add(with_priority(make_req("hi1", prompt_of(4, 2), 3), 0))
    hi2 = h.add(with_priority(make_req("hi2", prompt_of(4, 3), 3), 0))
    out, _ = h.step()
    assert sched_ids(out) == ["hi1", "hi2"] and [r.request_id for r in h.sched.waiting] == ["low"]
    h.run_to_completion()
    assert h.admission_order == ["hi1", "hi2", "low"]
    for r in (low, hi1, hi2):
        assert r.output_token_ids == alone(r.prompt_token_ids, 3)[0]
    # preemption picks the largest priority value even if it arrived first
    h = Harness(num_blocks=1 + 5, block_size=4, budget=BIG, scheduling_policy="priority")
    bg = h.add(with_priority(make_req("bg", prompt_of(4, 4), 12), 9))
    fg = h.add(with_priority(make_req("fg", prompt_of(4, 5), 12), 0))
    h.run_to_completion()
    assert bg.num_preemptions >= 1 and fg.num_preemptions == 0


def test_fcfs_refuses_priorities_and_preempts_the_latest_arrival():
    """Under the default "fcfs" policy a non-zero priority is refused (``param`` "priority",
    nothing queued); priority-0 requests run in arrival order and the latest is the victim."""
    h = Harness(num_blocks=1 + 5, block_size=4, budget=BIG)
    with pytest.raises(RequestError, match="--scheduling-policy priority") as ei:
        h.sched.add_request(with_priority(make_req("p", prompt_of(4, 6), 3), -1))
    assert ei.value.param == "priority" and not h.sched.requests and not h.sched.waiting
    first = h.add(make_req("first", prompt_of(4, 4), 12))
    later = h.add(make_req("later", prompt_of(4, 5), 12))
    h.run_to_completion()
    assert later.num_preemptions >= 1 and first.num_preemptions == 0
    assert h.admission_order[0] == "first"


def test_waiting_queue_is_bounded():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=BIG, max_num_waiting=2)
    for i in range(2):
        s.add_request(make_req(f"r{i}", prompt_of(4, i), 2))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        s.add_request(make_req("r2", prompt_of(4, 2), 2))
    assert "r2" not in s.requests


def test_prefill_chunk_cap_keeps_decodes_flowing():
    """A 60-token prompt with max_prefill_chunk 8 takes 8-token chunks while a decode runs in
    every step, decodes first."""
    kv = KVCacheManager(64, 4)
    h = Harness()
    h.kv, h.sched = kv, Scheduler(kv, 8, 64, BIG, max_prefill_chunk=8)
    d = h.add(make_req("d", prompt_of(3, 1), 30))
    h.step()
    long = h.add(make_req("long", prompt_of(60, 2), 2))
    while long.num_computed_tokens < 60:
        out, _ = h.step()
        assert sched_ids(out)[0] == "d" and out.scheduled[0].num_new_tokens == 1
        assert out.scheduled[1].num_new_tokens <= 8
    h.run_to_completion()
    assert d.output_token_ids == alone(d.prompt_token_ids, 30)[0]
    assert long.output_token_ids == alone(long.prompt_token_ids, 2)[0]


spec = st.fixed_dictionaries({"prompt_len": st.integers(1, 20), "max_tokens": st.integers(1, 14),
                              "arrival": st.integers(0, 8), "priority": st.integers(0, 2), "salt": st.integers(0, 999)})


def _spec(prompt_len, max_tokens):
    return {"prompt_len": prompt_len, "max_tokens": max_tokens, "arrival": 0, "priority": 0, "salt": 0}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(spec, min_size=2, max_size=7), block_size=st.sampled_from([1, 2, 4]),
       extra=st.integers(0, 3), budget=st.integers(2, 24), chunk=st.integers(1, 24))
# a resumed request recomputing its output in 1-token chunks next to a decode (found by hypothesis)
@example(specs=[_spec(1, 1)] * 4 + [_spec(1, 7), _spec(2, 4), _spec(1, 3)], block_size=1, extra=0, budget=3, chunk=1)
def test_hypothesis_tiny_pool_outputs_equal_large_pool(specs, block_size, extra, budget, chunk):
    """Random arrivals and priorities under a pool barely larger than the largest request:
    every request finishes with its large-pool output; check_integrity every step."""
    need = max(blocks_for(s["prompt_len"] + s["max_tokens"], block_size) for s in specs)
    kv = KVCacheManager(1 + need + extra, block_size)
    h = Harness(block_size=block_size)
    h.kv, h.sched = kv, Scheduler(kv, 4, budget, BIG, max_prefill_chunk=chunk, scheduling_policy="priority")
    reqs, step = {}, 0
    while step < 9 or h.sched.has_unfinished_requests():
        for i, s in enumerate(specs):
            if s["arrival"] == step:
                prompt = [(s["salt"] * 31 + 17 * j) % 900 + 30 for j in range(s["prompt_len"])]
                reqs[i] = h.add(with_priority(make_req(f"r{i}", prompt, s["max_tokens"]), s["priority"]))
        h.step()
        step += 1
        assert step < 5000, "no progress"
    h.assert_drained()
    assert h.sched.num_preemptions == sum(r.num_preemptions for r in reqs.values())
    for r in reqs.values():
        assert (r.output_token_ids, r.status.finish_reason) == alone(r.prompt_token_ids, r.sampling_params.max_tokens)
        assert r.status == RequestStatus.FINISHED_LENGTH


def test_seeded_sampling_params_survive_preemption():
    """Penalties and seeds live on the request, not the blocks: a preempted request keeps its
    output tokens and its sampling params (the engine-level check is case S2)."""
    h = Harness(num_blocks=1 + 6, block_size=4, budget=8)
    sp = SamplingParams(max_tokens=10, repetition_penalty=1.3, seed=3)
    a = h.add(Request("a", prompt_of(9, 1), sp))
    b = h.add(Request("b", prompt_of(9, 2), SamplingParams(max_tokens=10, seed=4)))
    h.run_to_completion()
    assert b.num_preemptions >= 1 and len(b.output_token_ids) == 10 and a.sampling_params is sp
