"""Admission waits for a prefix another request is computing (scheduler docstring, 3.).

Chats on one system prompt arriving while the first of them is still prefilling it must not
compute it again beside it: they wait until its blocks are cached and start from the hit. The
stub runner and harness of ``test_scheduler.py`` check every step's invariants and that the
tokens equal each request run alone.
"""

from __future__ import annotations

import pytest
from test_scheduler import BIG, Harness, StubRunner, alone, make_req, prompt_of, sched_ids

from llmd.daemon.core import scheduler
from llmd.daemon.core.scheduler import Scheduler
from llmd.daemon.kv import KVCacheManager

SHARED = prompt_of(40)  # 10 full blocks of 4


def chat(rid: str, k: int):
    return make_req(rid, SHARED + [900 + 10 * k + j for j in range(6)], 5, ignore_eos=True)


class HitRunner(StubRunner):
    """The stub runner, told that a request's first chunk may start after a prefix-cache hit:
    the hit blocks hold the tokens already (shared blocks), and every sample reads them back."""

    def execute(self, out):
        for s in out.scheduled:
            if s.request_id not in self.pos:
                self.pos[s.request_id] = s.num_computed_tokens
        return super().execute(out)


class SharingHarness(Harness):
    """The harness with prefix caching: block tables may share (hit) blocks, so its
    one-owner-per-block check gives way to the KV manager's own ref-count integrity check."""

    def check_invariants(self):
        self.kv.check_integrity()
        assert set(self.kv.request_ids()) == {r.request_id for r in self.sched.running}
        for r in self.sched.waiting:
            assert r.status.name == "WAITING" and self.kv.num_blocks_held(r.request_id) == 0


@pytest.fixture
def wait_for_any_run(monkeypatch):
    """Wait for an in-flight run of any length (the rule's mechanism, with SHARED's 10 blocks
    computed 2 per step: a threshold of 4 would admit the second chat for the last 2 blocks)."""
    monkeypatch.setattr(scheduler, "PREFIX_WAIT_MIN_BLOCKS", 1)


def harness(budget=32, chunk=8, caching=True) -> Harness:
    h = SharingHarness(num_blocks=128, block_size=4, max_num_seqs=8, budget=budget)
    h.kv = KVCacheManager(128, 4, enable_caching=caching)
    h.sched = Scheduler(h.kv, 8, budget, BIG, max_prefill_chunk=chunk)
    h.runner = HitRunner(4)
    return h


def prefill_tokens(h: Harness) -> int:
    return sum(s.num_new_tokens for out in h.outputs for s in out.scheduled if s.is_prefill)


def test_arriving_during_the_first_prefill_waits_for_the_hit(wait_for_any_run):
    h = harness()
    a = h.add(chat("a", 0))
    h.step()  # a computes its first chunk; b arrives now
    b = h.add(chat("b", 1))
    while "b" not in sched_ids(h.step()[0]):
        pass
    assert b.num_cached_tokens == 40 and a.num_cached_tokens == 0
    h.run_to_completion()
    assert prefill_tokens(h) == 46 + 6  # the shared 40 computed once
    for r, k in ((a, 0), (b, 1)):
        assert r.output_token_ids == alone(chat("x", k).prompt_token_ids, 5, ignore_eos=True)[0]


def test_arriving_together_the_second_waits_too(wait_for_any_run):
    """Admitted in the same step, the first's blocks are in flight for the second at once."""
    h = harness()
    reqs = [h.add(chat(f"c{k}", k)) for k in range(4)]
    h.run_to_completion()
    assert [r.num_cached_tokens for r in reqs] == [0, 40, 40, 40]
    assert prefill_tokens(h) == 46 + 3 * 6


def test_others_go_ahead_of_a_waiting_request(wait_for_any_run):
    """A request with another prompt behind the waiting one is admitted meanwhile."""
    h = harness()
    h.add(chat("a", 0))
    h.step()
    b = h.add(chat("b", 1))
    other = h.add(make_req("other", prompt_of(12, salt=5), 3, ignore_eos=True))
    out, _ = h.step()
    assert "other" in sched_ids(out) and "b" not in sched_ids(out)
    h.run_to_completion()
    assert b.num_cached_tokens == 40 and other.num_cached_tokens == 0


def test_without_prefix_caching_nobody_waits():
    h = harness(caching=False)
    h.add(chat("a", 0))
    h.step()
    h.add(chat("b", 1))
    assert "b" in sched_ids(h.step()[0])
    h.run_to_completion()
    assert prefill_tokens(h) == 2 * 46


def test_a_short_run_in_flight_is_computed_again_instead():
    """Fewer than ``PREFIX_WAIT_MIN_BLOCKS`` shared blocks in flight (two blocks of 4 here): the
    second request is admitted at once and computes them beside the first; with the run as long
    as the threshold it waits."""
    assert scheduler.PREFIX_WAIT_MIN_BLOCKS > 2
    short = prompt_of(8)
    h = harness()
    a = h.add(make_req("a", short + [901, 902, 903], 4, ignore_eos=True))
    b = h.add(make_req("b", short + [911, 912], 4, ignore_eos=True))
    out, _ = h.step()
    assert {"a", "b"} <= set(sched_ids(out))  # b did not wait for a's two blocks
    h.run_to_completion()
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert prefill_tokens(h) == 11 + 10
    h = harness()
    long = prompt_of(4 * scheduler.PREFIX_WAIT_MIN_BLOCKS)
    h.add(make_req("a", long + [901, 902, 903], 4, ignore_eos=True))
    c = h.add(make_req("c", long + [911, 912], 4, ignore_eos=True))
    out, _ = h.step()
    assert "c" not in sched_ids(out)
    h.run_to_completion()
    # it waited while the run in flight was long enough, then computed the short tail itself
    assert 0 < c.num_cached_tokens and len(long) - c.num_cached_tokens < 4 * scheduler.PREFIX_WAIT_MIN_BLOCKS
