"""``llmd bench routing``'s parts: the workload and report arithmetic (milliseconds), and its
phases run for real (:func:`llmd.daemon.bench.routing.run_phase`: the real vllm-router, fresh per
policy, in front of three in-process tiny workers on loopback TCP with a key; short documents,
since the tiny model's context is 512 tokens): both policies send the same prompts and get the
same replies, round robin uses every replica, and cache-aware routing's hit rate is above
round robin's and above 0.45 (measured: 0.57 every run; round robin 0.15-0.44 with these
three-turn chats, its spread depending on the order the four users' requests arrive in). The SmolLM2 run with three
``llmd serve`` processes is the README's record (not a test: minutes)."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
from app_harness import start_loop
from router_workers import start_worker

from llmd.daemon.bench.routing import POLICIES, find_router, run_phase, run_routing_bench
from llmd.daemon.bench.routing_workload import (
    QUESTIONS,
    PhaseResult,
    ReplicaDelta,
    document,
    replica_delta,
    report,
    turn_messages,
)
from llmd.daemon.core.errors import LlmdError

KEY = "bench-test-" + os.urandom(8).hex()


def stats(queries: int, hits: int, computed: int, finished: int) -> dict:
    return {"prefix_cache": {"queries": queries, "hits": hits},
            "counters": {"prompt_tokens": computed, "requests_finished": {"stop": finished, "length": 1}}}


def test_each_user_has_a_document_of_their_own():
    docs = [document(u) for u in range(30)]
    assert docs == [document(u) for u in range(30)]  # seeded
    assert all(len(d.split()) == 12 + 816 for d in docs)
    bodies = [d.split("\n\n", 1)[1] for d in docs]
    assert len({b[:40] for b in bodies}) == 30  # no two start alike
    assert sorted(bodies[0].split()) == sorted(bodies[1].split())  # the same words, their own order
    assert len(document(3, words=12).split("\n\n", 1)[1].split()) == 12
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    msgs = turn_messages(docs[2], history, 9)
    assert msgs[0] == {"role": "system", "content": docs[2]} and msgs[1:3] == history
    assert msgs[-1] == {"role": "user", "content": QUESTIONS[9 % len(QUESTIONS)]}


def test_hit_rate_is_summed_over_replicas_and_the_report_states_the_ratio():
    d = replica_delta(stats(100, 10, 90, 3), stats(1100, 510, 590, 7))
    assert d == ReplicaDelta(queries=1000, hits=500, computed=500, requests=4)
    rr = PhaseResult("round_robin", [ReplicaDelta(1000, 100, 900, 4), ReplicaDelta(1000, 200, 800, 4)], 5.0, [["x"]])
    ca = PhaseResult("cache_aware", [ReplicaDelta(1000, 600, 400, 5), ReplicaDelta(1000, 600, 400, 3)], 4.0, [["x"]])
    assert rr.hit_rate == 0.15 and ca.hit_rate == 0.6
    lines = report([rr, ca], "workload: shape")
    assert lines[0] == "workload: shape" and "4/4" in lines[2] and "0.150" in lines[2] and "0.600" in lines[3]
    assert lines[4] == "cache_aware / round_robin hit rate: 4.00x (target >= 2x: met)"
    assert lines[5].endswith("yes")
    ca.replies = [["y"]]
    assert report([rr, ca], "s")[-1].endswith("NO (the workloads differ)")
    assert "missed" in report([rr, PhaseResult("cache_aware", rr.replicas, 1.0, [["x"]])], "s")[4]


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(LlmdError, match="must be >= 1"):
        run_routing_bench(3, 0, 4, 32, [])


@pytest.fixture(scope="module")
def engine_loops(tmp_path_factory):
    try:
        find_router()
    except LlmdError:
        pytest.skip("vllm-router is not installed (pip install -e '.[cluster]')")
    loops = [start_loop(tmp_path_factory, max_num_seqs=4) for _ in range(3)]
    yield loops
    for loop in loops:
        loop.stop()


def test_phases_through_the_real_router(engine_loops, tmp_path):
    async def main():
        workers = [await start_worker(loop, KEY) for loop in engine_loops]
        urls = [u for _, u in workers]
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                return [await run_phase(s, find_router(), urls, policy, KEY, str(tmp_path), users=4, turns=3,
                                        max_tokens=4, doc_words=12) for policy in POLICIES]
        finally:
            for runner, _ in workers:
                await runner.cleanup()

    rr, ca = asyncio.run(main())
    assert [p.policy for p in (rr, ca)] == ["round_robin", "cache_aware"]
    for p in (rr, ca):
        assert sum(r.requests for r in p.replicas) == 12 and p.queries > 12 * 200
    assert rr.queries == ca.queries and rr.replies == ca.replies  # the same prompts, the same replies
    assert all(r.requests for r in rr.replicas)  # round robin used every replica
    assert ca.hit_rate > rr.hit_rate and ca.hit_rate > 0.45, (rr, ca)
