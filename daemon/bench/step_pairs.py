"""The timing and pairing helpers of ``llmd bench step`` (:mod:`llmd.daemon.bench.step`): the
read-bandwidth probe, other processes' CPU share, medians of timed calls, and the measurements
that pair each repetition with what it is divided by (a bandwidth read, the KV-gather read, the
floor's own components), so a ratio compares the same machine phase. On the 2-core machines of
this project the read bandwidth swung 26–48 GB/s and the same batch-32 linears 23–41 ms within
minutes (2026-12-06): a ratio of medians taken minutes apart mixes those phases.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from llmd.quant.kv import PagedKVCache


class CpuOther:
    """Share of all cores used by *other* processes between start and :meth:`frac` (Linux
    ``/proc/stat`` busy ticks minus this process's ``os.times``); NaN where /proc is absent."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.monotonic(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except OSError:
            return float("nan")
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # seconds busy, all cores

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def frac(self) -> float:
        wall = max(1e-9, time.monotonic() - self.t0)
        other = (self._busy() - self.busy0) - (self._own() - self.own0)
        return max(0.0, other / (wall * (os.cpu_count() or 1)))


class BandwidthProbe:
    """Read bandwidth of ``device``: ``x.sum()`` over a ``mib``-MiB float32 tensor, allocated
    and filled once (:meth:`read` reuses it)."""

    def __init__(self, device: torch.device, mib: int = 512):
        self.device = device
        self.x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
        self.x.sum()

    def read(self, tries: int = 2) -> float:
        """Best of ``tries`` sums; bytes/s."""
        best = min(timed(lambda: self.x.sum(), self.device) for _ in range(tries))
        return self.x.numel() * 4 / best


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes (synchronizing CUDA around it)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def median_time(fn: Callable, reps: int, device: torch.device, setup: Callable | None = None) -> float:
    """Median seconds of ``reps`` calls after one warm-up; ``setup()`` (untimed) feeds ``fn``."""
    ts = []
    for _ in range(reps + 1):
        arg = setup() if setup else None
        ts.append(timed((lambda: fn(arg)) if setup else fn, device))
    return statistics.median(ts[1:])


def paired_attention(attention: Callable, setup: Callable, reps: int, probe: BandwidthProbe,
                     device: torch.device, gather: Callable | None = None) -> tuple[float, float, list[tuple]]:
    """``attention(setup())`` timed ``reps`` times after one warm-up, each right after a bandwidth
    read (:meth:`BandwidthProbe.read`, untimed, as is ``setup``) and, with ``gather``, right after
    a timed ``gather()`` (the KV-gather read). Returns (median seconds, median bytes/s, the
    (seconds, bytes/s, gather seconds or NaN) triples)."""
    pairs = []
    for i in range(reps + 1):
        arg = setup()
        bw = probe.read()
        g = timed(gather, device) if gather is not None else float("nan")
        t = timed(lambda: attention(arg), device)
        if i:
            pairs.append((t, bw, g))
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs), pairs


def gather_reader(engine, inputs) -> Callable[[], None] | None:
    """A callable that reads every K/V byte the decode step of ``inputs`` (``prepare_inputs``'s
    result) attends to, layer by layer through the step's block tables, and nothing else
    (:func:`llmd.kernels.cpu_native.gather_read`): the KV-gather floor. None on a GPU, without the
    C library, or for caches it does not read (int4, grouped scales)."""
    from llmd.kernels import cpu_native, cpu_plan
    from llmd.kernels.native import build

    runner, cfg = engine.runner, engine.model_config
    if runner.device.type != "cpu" or build.load_kv_read() is None:
        return None
    meta, group = inputs[2], cfg.num_heads // cfg.num_kv_heads
    work = []
    for i, cache in enumerate(runner.layer_caches):
        c = PagedKVCache.wrap(cache)
        if c.fmt.k_per_block or c.fmt.group_size:
            return None
        m = meta[i] if isinstance(meta, list) else meta
        d = cpu_plan.build_plan(m, cfg.num_kv_heads, cfg.layer_window(i), group, cascade_ok=False, native=True)
        work.append((c, d.native))
    return lambda: [cpu_native.gather_read(c, d) for c, d in work]


def paired_step(step: Callable[[], object], linears: Callable[[], object], lm_head: Callable[[], object],
                probe: BandwidthProbe, kv_bytes: int, reps: int, device: torch.device) -> tuple[float, list[tuple]]:
    """The step against its floor, one repetition at a time: a bandwidth read (untimed), then
    ``linears()``, ``lm_head()`` and ``step()`` each timed, back to back; ``reps`` repetitions
    after one warm-up. Returns (the median over repetitions of step / (linears + lm_head +
    ``kv_bytes`` / bandwidth), the (step, linears, lm_head, bytes/s) tuples)."""
    rows = []
    for i in range(reps + 1):
        bw = probe.read()
        lin, head, st = timed(linears, device), timed(lm_head, device), timed(step, device)
        if i:
            rows.append((st, lin, head, bw))
    return statistics.median(st / (lin + head + kv_bytes / bw) for st, lin, head, bw in rows), rows
