"""Fewer CPU threads while other processes keep this process's cores busy, all of them again
once they stop (the CPU engine, when ``--threads`` and ``$OMP_NUM_THREADS`` are not given).

Why: torch's OpenMP team (libgomp) and llmd's C kernels split every op statically across their
threads and meet at a barrier, where a thread that is done spins for up to 300,000 ``pause``
iterations (libgomp's default ``GOMP_SPINCOUNT``; ~7.7 ms at 25.6 ns a ``pause`` on the 2-core
AMD EPYC) before it sleeps. When another process runs on one of the cores, the thread that shares
it waits for the scheduler's next time slice while its partner spins on the other core, so
every barrier can cost milliseconds. Measured there with one ``yes > /dev/null`` beside SmolLM2
(bfloat16, 2 cores; README "Threads when other processes share the cores"): a batch-32 decode
step 110–250 ms with 2 threads against 82 ms with 1 (48 ms alone), a batch-1 step 8.2–9.8 ms
median and up to 80 ms p90 against 6.3 ms. llama.cpp's ``llama-bench`` tg64 fell from 105.9 to
32.4 tok/s under the same load (79.0 with ``-t 1``).

How: every :data:`INTERVAL_S` (checked after each engine step, so nothing runs while the engine
is idle), the busy CPU time of the cores this process may use (``/proc/stat``: user, nice,
system, irq, softirq, steal) minus this process's own (``os.times()``) gives how many cores other
processes kept busy. The thread count becomes ``max_threads − round(others)`` (at least 1) once
two intervals in a row agree, through ``torch.set_num_threads`` (llmd's C kernels read
``torch.get_num_threads()`` on every call). Two llmd daemons on the same cores thus settle at
a share each, as the README's "split the cores" advice would set them by hand.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

log = logging.getLogger("llmd.threads")

INTERVAL_S = 0.5  #: seconds between two looks at /proc/stat
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  #: /proc/stat cpuN columns counted busy: user nice system irq softirq steal


def read_busy(cpus: set[int], path: str = "/proc/stat") -> float | None:
    """Busy seconds so far of ``cpus`` (``/proc/stat``'s per-CPU lines, in ``USER_HZ`` ticks),
    or None when the file cannot be read (not Linux)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    hz, total = os.sysconf("SC_CLK_TCK"), 0
    for line in lines:
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *vals = line.split()
            if int(name[3:]) in cpus:
                total += sum(int(vals[i]) for i in BUSY_FIELDS if i < len(vals))
    return total / hz


def read_self() -> float:
    """CPU seconds this process has used (user + system, all its threads)."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Adapts the engine's CPU threads to what other processes leave free (module docstring).

    Args:
        max_threads: the thread count when the cores are free (``--threads``' default).
        cpus: the CPUs this process may run on (default: ``os.sched_getaffinity(0)``).
        busy, own: readers of the cores' busy seconds and this process's (tests inject them).
        set_threads: applies a count (default ``torch.set_num_threads``).
        clock: monotonic seconds.
    """

    def __init__(self, max_threads: int, cpus: set[int] | None = None, busy: Callable[[], float | None] | None = None,
                 own: Callable[[], float] = read_self, set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if cpus is None:
            cpus = set(os.sched_getaffinity(0))
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.max_threads, self.threads = max_threads, max_threads
        self._busy = busy if busy is not None else (lambda: read_busy(cpus))
        self._own, self._set, self._clock = own, set_threads, clock
        self._last = self._sample()
        self._pending: int | None = None
        self.others = 0.0  #: cores other processes kept busy over the last interval

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._busy(), self._own()

    def tick(self) -> int | None:
        """After a step: every :data:`INTERVAL_S`, measure and maybe change the thread count.
        Returns the new count when it changed, else None."""
        now = self._clock()
        if now - self._last[0] < INTERVAL_S:
            return None
        t, busy, own = self._sample()
        (t0, busy0, own0), self._last = self._last, (t, busy, own)
        if busy is None or busy0 is None:
            return None
        self.others = max(0.0, (busy - busy0) - (own - own0)) / (t - t0)
        want = max(1, min(self.max_threads, self.max_threads - int(self.others + 0.5)))
        if want == self.threads:
            self._pending = None
            return None
        if self._pending != want:  # two intervals in a row must agree
            self._pending = want
            return None
        self._pending, self.threads = None, want
        self._set(want)
        log.info("other processes kept ~%.1f of %d cores busy: %d thread%s now", self.others, self.max_threads,
                 want, "" if want == 1 else "s")
        return want
