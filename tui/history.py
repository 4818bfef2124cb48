"""Rolling history of stats samples: sparkline series and windowed prefix-cache hit rates.

Pure Python (no Textual). :meth:`History.add` takes one ``/v1/stats`` payload and the
monotonic time it arrived; a daemon restart (uptime or a counter going backwards) clears the
history so rates never go negative. Every field is read with a default: a payload missing
one never raises.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmd.tui.stats_view import num

HIT_WINDOW_S = 60.0
MAX_SAMPLES = 600  # 10 min at 1 s


@dataclass(frozen=True)
class Sample:
    """The numbers of one stats payload the dashboard keeps over time."""

    t: float
    uptime: float
    queries: float
    hits: float
    prompt_tps: float
    gen_tps: float
    running: float
    waiting: float
    preemptions: float


def sample_of(stats: dict, t: float) -> Sample:
    """Extract a :class:`Sample` from a stats payload (missing fields read as 0)."""
    return Sample(
        t=t, uptime=num(stats, "uptime_s", default=float("nan")),  # unknown: never looks like a restart
        queries=num(stats, "prefix_cache", "queries"), hits=num(stats, "prefix_cache", "hits"),
        prompt_tps=num(stats, "throughput", "prompt_tokens_per_s"),
        gen_tps=num(stats, "throughput", "generation_tokens_per_s"),
        running=num(stats, "scheduler", "running"), waiting=num(stats, "scheduler", "waiting"),
        preemptions=num(stats, "counters", "num_preemptions"),
    )


class History:
    """The last ``maxlen`` samples; :attr:`restarted` is True right after a detected restart."""

    def __init__(self, maxlen: int = MAX_SAMPLES):
        self.samples: deque[Sample] = deque(maxlen=maxlen)
        self.restarted = False

    def add(self, stats: dict, t: float) -> Sample:
        """Append the sample of ``stats`` taken at monotonic time ``t``; returns it."""
        s = sample_of(stats, t)
        last = self.samples[-1] if self.samples else None
        self.restarted = last is not None and (
            s.uptime < last.uptime or s.queries < last.queries or s.hits < last.hits
            or s.preemptions < last.preemptions)
        if self.restarted:
            self.samples.clear()
        self.samples.append(s)
        return s

    def clear(self) -> None:
        """Forget every sample (e.g. after reconnecting to another daemon)."""
        self.samples.clear()

    def series(self, name: str, n: int | None = None) -> list[float]:
        """The last ``n`` values (all when None) of a :class:`Sample` field, oldest first."""
        vals = [getattr(s, name) for s in self.samples]
        return vals if n is None else vals[-n:]

    def hit_rate_total(self) -> float | None:
        """Prefix-cache hits / queries since the daemon started (None: no queries yet)."""
        if not self.samples or self.samples[-1].queries <= 0:
            return None
        s = self.samples[-1]
        return s.hits / s.queries

    def hit_rate_window(self, window_s: float = HIT_WINDOW_S) -> float | None:
        """Hit rate over the last ``window_s`` seconds (None: no queries in the window).

        Uses the oldest sample no older than the window as the base; before a window has
        passed, the rate since the first sample kept.
        """
        if not self.samples:
            return None
        last = self.samples[-1]
        base = next((s for s in self.samples if last.t - s.t <= window_s), last)
        if base is last and len(self.samples) == 1:
            # a single sample: the daemon's whole history is the best window we have
            return self.hit_rate_total() if last.uptime <= window_s else None
        dq, dh = last.queries - base.queries, last.hits - base.hits
        return dh / dq if dq > 0 else None
