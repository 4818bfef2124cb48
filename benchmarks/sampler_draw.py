"""The sampler's draw, side by side in one run: the exponential race llmd used until 2026-12-03
(``argmax(probs / q)``, ``q ~ Exp(1)`` per vocabulary entry from the row's seeded generator:
vLLM's ``random_sample``) against the inverse transform draw it uses now
(:func:`llmd.daemon.core.sampler.inverse_transform_draw`: one float64 uniform against the
cumulative probabilities). Both through :class:`llmd.daemon.core.sampler.Sampler` on the same
logits (temperature 0.8, no filters, seeded requests), ms per sampling step.

    python benchmarks/sampler_draw.py                 # SmolLM2's vocabulary, batches 1 and 32
    python benchmarks/sampler_draw.py --vocab 262144  # Gemma 3's
"""

from __future__ import annotations

import argparse
import time

import torch

import llmd.daemon.core.sampler as sampler_module
from llmd.daemon.core.request import Request, SamplingParams
from llmd.daemon.core.sampler import Sampler


def exponential_race(probs: torch.Tensor, gen: torch.Generator) -> int:
    """The former draw (kept here only to measure it)."""
    q = torch.empty_like(probs).exponential_(generator=gen)
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    return int(torch.argmax(probs / q))


def step_ms(logits: torch.Tensor, reqs: list[Request], reps: int) -> float:
    sampler = Sampler()
    sampler(logits, reqs)
    t = time.perf_counter()
    for _ in range(reps):
        sampler(logits, reqs)
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draws = {"exponential race": exponential_race, "inverse transform": sampler_module.inverse_transform_draw}
    print(f"vocab {args.vocab}, {args.threads} threads, temperature 0.8; ms per sampling step (best of 2 rounds)")
    for b in map(int, args.batches.split(",")):
        logits = torch.randn(b, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
        reqs = [Request(request_id=f"r{i}", prompt_token_ids=[1, 2],
                        sampling_params=SamplingParams(temperature=0.8, seed=i)) for i in range(b)]
        best = {}
        for _ in range(2):  # interleaved rounds
            for name, draw in draws.items():
                sampler_module.inverse_transform_draw = draw
                try:
                    ms = step_ms(logits, reqs, max(3, 200 // b))
                finally:
                    sampler_module.inverse_transform_draw = draws["inverse transform"]
                best[name] = min(best.get(name, ms), ms)
        race, inv = best["exponential race"], best["inverse transform"]
        print(f"batch {b:>3}: exponential race {race:7.2f} ms, inverse transform {inv:6.2f} ms ({race / inv:.1f}x)")


if __name__ == "__main__":
    main()
