"""The adaptive CPU threads (:mod:`llmd.daemon.core.thread_governor`): the count follows what
other processes leave free, after two agreeing intervals, never below 1 or above the cores; an
engine whose threads were not given adapts, one given ``--threads`` does not."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_engine import tiny_engine

from llmd.daemon.core import thread_governor as tg


class Fake:
    """A clock and CPU counters the test advances: ``others`` / ``own`` cores busy per second."""

    def __init__(self):
        self.t, self.busy, self.own = 0.0, 0.0, 0.0

    def advance(self, seconds: float, others: float, own: float = 2.0):
        self.t += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own


def governor(fake, max_threads=2, applied=None):
    return tg.ThreadGovernor(max_threads, cpus={0, 1}, busy=lambda: fake.busy, own=lambda: fake.own,
                             set_threads=(applied.append if applied is not None else lambda n: None),
                             clock=lambda: fake.t)


def test_threads_follow_the_free_cores_after_two_agreeing_intervals():
    fake, applied = Fake(), []
    g = governor(fake, 4, applied)
    fake.advance(0.2, others=1.0)
    assert g.tick() is None  # before INTERVAL_S: nothing measured
    for others, want in ((0.1, None), (1.0, None), (1.0, 3), (2.2, None), (2.2, 2), (0.3, None), (0.0, 4)):
        fake.advance(tg.INTERVAL_S, others)
        assert g.tick() == want, (others, want)
    assert applied == [3, 2, 4] and g.threads == 4
    for _ in range(2):  # more busy cores than ours: still one thread
        fake.advance(tg.INTERVAL_S, others=9.0)
        g.tick()
    assert g.threads == 1 and applied[-1] == 1
    fake.advance(tg.INTERVAL_S, others=0.0)  # one free interval does not flip it back
    assert g.tick() is None and g.threads == 1


def test_read_busy_counts_only_our_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 900 0 0 0 0 0 0\ncpu0 10 1 20 500 7 2 3 4 0 0\ncpu1 1000 0 0 0 0 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert tg.read_busy({0}, str(stat)) == pytest.approx((10 + 1 + 20 + 2 + 3 + 4) / hz)  # not idle, not iowait
    assert tg.read_busy({0, 1}, str(stat)) == pytest.approx((40 + 1000) / hz)
    assert tg.read_busy({0}, str(tmp_path / "missing")) is None
    assert tg.read_busy(set(os.sched_getaffinity(0))) > 0  # this machine's /proc/stat


def test_an_engine_adapts_only_when_its_threads_were_not_given(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMD_ADAPTIVE_THREADS", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        eng = tiny_engine(tmp_path / "t.gguf", threads=None)
        if eng.config.threads < 2:
            pytest.skip("one core: nothing to adapt")
        g = eng.thread_governor
        assert g is not None and "fewer while other processes keep cores busy" in eng.runtime_summary()
        fake = Fake()
        g._busy, g._own, g._clock = (lambda: fake.busy), (lambda: fake.own), (lambda: fake.t)
        g._last = g._sample()
        from llmd.daemon.core.request import SamplingParams

        eng.add_request(list(range(40, 60)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        while eng.has_unfinished_requests():
            fake.advance(tg.INTERVAL_S, others=eng.config.threads - 1)  # a busy process on all cores but one
            eng.step()
        assert torch.get_num_threads() == 1 and g.threads == 1
        runtime = eng.make_stats().to_dict("tiny", 1.0)["runtime"]  # /v1/stats, llmd status's engine: line
        assert runtime.endswith(f"; now 1 thread: other processes kept ~{g.others:.1f} of {g.max_threads} cores busy")
        assert tiny_engine(tmp_path / "u.gguf", threads=2).thread_governor is None  # --threads given: fixed
    finally:
        torch.set_num_threads(before)
