"""Decode steps with and without another busy process on the cores, adaptive threads on and off.

    python benchmarks/contended_threads.py [--rounds 2] [--model smollm2-135m]

Each cell is a fresh process (the thread settings are per process): it builds the default engine
(``build_engine()``: ``--threads`` not given, so :mod:`llmd.daemon.core.thread_governor` adapts
unless ``LLMD_ADAPTIVE_THREADS=0``) and times ``Engine.step()``: a batch-32 decode step (32
requests of 301-token prompts; the median of the last 20 decode steps of 30, after a warm-up
request) and a batch-1 decode step (the median and p90 of the last 200 steps of 400). "busy"
runs ``yes > /dev/null`` beside it (free to run on any core). Prints one line per cell, the
settings alternating, ``--rounds`` times. README: "Threads when other processes share the cores".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def measure(model: str) -> str:
    from llmd.daemon.cli.common import build_engine
    from llmd.daemon.core.request import SamplingParams

    engine = build_engine(model=model)

    def steps(batch: int, new: int) -> list[float]:
        for i in range(batch):
            engine.add_request([100 + i] + list(range(200, 500)),
                               SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return times

    steps(32, 30)  # warm-up (and the prompts' prefix cache: later runs time decode steps only)
    b32 = sorted(steps(32, 30)[-20:])
    b1 = sorted(steps(1, 400)[-200:])
    return (f"batch-32 step {b32[len(b32) // 2] * 1e3:.1f} ms, batch-1 step {b1[len(b1) // 2] * 1e3:.1f} ms "
            f"(p90 {b1[int(len(b1) * 0.9)] * 1e3:.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(measure(args.model), flush=True)
        return
    for busy in (False, True):
        hog = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
        try:
            for _ in range(args.rounds):
                for adaptive in ("1", "0"):
                    env = {**os.environ, "LLMD_ADAPTIVE_THREADS": adaptive}
                    out = subprocess.run([sys.executable, __file__, "--measure", "--model", args.model], env=env,
                                         capture_output=True, text=True, check=True).stdout.strip()
                    print(f"{'busy' if busy else 'alone'} adaptive {'on ' if adaptive == '1' else 'off'}: {out}",
                          flush=True)
        finally:
            if hog is not None:
                hog.kill()


if __name__ == "__main__":
    main()
