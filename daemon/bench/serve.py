"""``llmd bench serve``: open-loop load on a running daemon over its socket.

Requests arrive as a Poisson process at ``rate`` requests/s (exponential gaps, seeded), each
with a seeded prompt length and output length (greedy, ``ignore_eos`` so every request
generates exactly its drawn number of tokens), streamed so per-token times are seen. Open
loop: arrivals never wait for earlier requests to finish (vLLM ``benchmark_serving``).

Metrics (vLLM's definitions): TTFT = first token time − send time; TPOT = (e2e − TTFT) /
(output tokens − 1) per request; ITL = gaps between consecutive streamed chunks; throughput
= output tokens / wall seconds from the first send to the last finish.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from llmd.daemon.client.client import AsyncClient


@dataclass
class Sample:
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


def percentile(xs: list[float], p: float) -> float:
    """Nearest-rank percentile of ``xs`` (``p`` in 0..100); 0.0 for an empty list."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


async def _one(ac: AsyncClient, prompt: list[int], max_tokens: int) -> Sample:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    s, last = Sample(), None
    async for chunk in ac.stream("/v1/completions", body):
        now = time.perf_counter()
        if chunk.get("usage"):
            s.output_tokens = chunk["usage"]["completion_tokens"]
            continue
        if last is None:
            s.ttft = now - t0
        else:
            s.itl.append(now - last)
        last = now
    s.e2e = time.perf_counter() - t0
    return s


async def run_serve_bench(socket_path: str, num_requests: int, rate: float, prompt_range: tuple[int, int],
                          output_range: tuple[int, int], seed: int, vocab: tuple[int, int] = (100, 20000),
                          echo=print) -> dict:
    """Run the load and print a summary; returns the numbers (seconds, tokens/s)."""
    rng = random.Random(seed)
    work = [([rng.randrange(*vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(num_requests)]
    gaps = [rng.expovariate(rate) for _ in range(num_requests)]
    async with AsyncClient(socket_path, timeout=None) as ac:
        await ac.request("GET", "/health")  # no daemon (or one still loading): one line now, not after the arrivals
        tasks = []
        t0 = time.perf_counter()
        for (prompt, n), gap in zip(work, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_one(ac, prompt, n)))
        samples = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    out_tokens = sum(s.output_tokens for s in samples)
    ttft = [s.ttft for s in samples]
    tpot = [(s.e2e - s.ttft) / (s.output_tokens - 1) for s in samples if s.output_tokens > 1]
    itl = [g for s in samples for g in s.itl]
    res = {"requests": num_requests, "rate": rate, "wall_s": wall, "output_tokens": out_tokens,
           "output_tokens_per_s": out_tokens / wall, "requests_per_s": num_requests / wall}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        res[f"{name}_p50_ms"] = 1000 * percentile(xs, 50)
        res[f"{name}_p99_ms"] = 1000 * percentile(xs, 99)
        res[f"{name}_mean_ms"] = 1000 * (statistics.fmean(xs) if xs else 0.0)
    echo(f"{num_requests} requests at {rate:g} req/s (Poisson, seed {seed}): {wall:.1f} s, "
         f"{res['output_tokens_per_s']:.1f} output tok/s, {res['requests_per_s']:.2f} req/s")
    for name in ("ttft", "tpot", "itl"):
        echo(f"  {name.upper():<5} p50 {res[f'{name}_p50_ms']:8.1f} ms   p99 {res[f'{name}_p99_ms']:8.1f} ms   "
             f"mean {res[f'{name}_mean_ms']:8.1f} ms")
    return res
