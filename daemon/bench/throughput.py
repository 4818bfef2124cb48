"""``llmd bench throughput``: continuous vs static batching, side by side in one process.

Both modes run the same seeded mixed-length requests through the same engine (same runner,
same ``max_num_seqs``), greedy with ``ignore_eos`` so every request generates exactly its
drawn number of tokens in both modes:

* static: requests are cut into fixed batches of ``max_num_seqs``; a batch runs until its
  longest member finishes, and only then does the next batch start (the padding waste is the
  decode slots finished members leave idle while they wait);
* continuous: all requests are queued at once and the scheduler refills a slot as soon as a
  request finishes (iteration-level batching, Orca OSDI'22).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmd.daemon.core.request import SamplingParams


@dataclass
class BenchResult:
    """One mode's totals: output tokens, wall seconds, engine steps, idle decode slots."""

    output_tokens: int
    seconds: float
    steps: int
    padding_slots: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int, vocab: int):
    """Seeded requests: a list of (prompt token ids, max_tokens)."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def _run(engine, workload) -> tuple[int, int]:
    for prompt, max_tokens in workload:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens = steps = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    return tokens, steps


def run_static(engine, workload) -> BenchResult:
    """Fixed batches of ``max_num_seqs`` that wait for their longest member."""
    batch = engine.config.max_num_seqs
    t0 = time.perf_counter()
    tokens = steps = padding = 0
    for i in range(0, len(workload), batch):
        group = workload[i : i + batch]
        longest = max(m for _, m in group)
        padding += sum(longest - m for _, m in group)
        t, s = _run(engine, group)
        tokens, steps = tokens + t, steps + s
    return BenchResult(tokens, time.perf_counter() - t0, steps, padding)


def run_continuous(engine, workload) -> BenchResult:
    """Everything queued at once; the scheduler refills slots every step."""
    t0 = time.perf_counter()
    tokens, steps = _run(engine, workload)
    return BenchResult(tokens, time.perf_counter() - t0, steps)


def run_throughput_bench(engine, num_requests: int, prompt_range, output_range, seed: int,
                         echo: Callable[[str], None] = print):
    """Run static then continuous batching on the same workload and print both and their ratio.

    Returns:
        (static BenchResult, continuous BenchResult).
    """
    workload = make_workload(num_requests, prompt_range, output_range, seed, engine.model_config.vocab_size)
    _run(engine, workload[:2])  # warm-up (allocators, kernels) outside the timed runs
    static = run_static(engine, workload)
    cont = run_continuous(engine, workload)
    total_slots = static.output_tokens + static.padding_slots
    echo(f"workload: {num_requests} requests, prompts {prompt_range[0]}-{prompt_range[1]} tokens, "
         f"outputs {output_range[0]}-{output_range[1]} tokens, seed {seed}, max_num_seqs {engine.config.max_num_seqs}, "
         f"token budget {engine.config.max_num_batched_tokens}, {engine.config.device} {engine.config.dtype}")
    echo(f"static batching:     {static.output_tokens} tokens in {static.seconds:.2f} s = "
         f"{static.tokens_per_s:.1f} tok/s, {static.steps} steps, padding waste {static.padding_slots}/{total_slots} "
         f"decode slots ({static.padding_slots / total_slots:.0%})")
    echo(f"continuous batching: {cont.output_tokens} tokens in {cont.seconds:.2f} s = {cont.tokens_per_s:.1f} tok/s, "
         f"{cont.steps} steps")
    echo(f"continuous / static throughput: {cont.tokens_per_s / static.tokens_per_s:.2f}x")
    return static, cont
