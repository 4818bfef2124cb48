"""Prefill with the bfloat16-scores kernels (kernels/cpu_scores.py) on vs off, side by side.

    python benchmarks/prefill_scores.py [--model smollm2-135m] [--prompts 512,2000] [--rounds 5]

One engine in this process (the model's defaults: bfloat16 where the CPU has native bf16, the cpu
attention backend); each round prefills a prompt of each length (random token ids, one output
token, the prefix cache reset first) with ``cpu_scores.set_enabled(True)`` (scores, mask and
softmax in one C call for an ``auto`` cache) and then ``False`` (K converted to float32, a float32
``baddbmm``, torch's softmax, a bfloat16 copy), so both see the same machine phase. Prints
the median wall time of each and their ratio. Needs a CPU with AVX512-BF16 (else the kernel is
unavailable and the script says so).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.request import SamplingParams
from llmd.kernels import cpu_scores
from llmd.kernels.native import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="512,2000", help="prompt lengths (tokens), comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if not cpu_scores.available():
        raise SystemExit(f"prefill_scores: the kernel is unavailable here ({build.scores_why_not})")
    cfg = EngineConfig(model=a.model).resolve()
    cfg.apply_threads()
    eng = Engine.from_config(cfg)
    rng = random.Random(0)
    lengths = [int(x) for x in a.prompts.split(",")]
    prompts = {n: [rng.randrange(100, min(40000, eng.model_config.vocab_size)) for _ in range(n)] for n in lengths}

    def prefill(ids: list[int]) -> float:
        eng.reset_prefix_cache()
        eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - t0

    times = {(n, on): [] for n in lengths for on in (True, False)}
    for n in lengths:  # warm-up: plans, buffers, the kernel's first load
        prefill(prompts[n])
    for _ in range(a.rounds):
        for n in lengths:
            for on in (True, False):
                cpu_scores.set_enabled(on)
                times[(n, on)].append(prefill(prompts[n]))
    cpu_scores.set_enabled(True)
    print(f"prefill_scores: {a.model}, {cfg.dtype}, {cfg.threads} threads, max_num_batched_tokens "
          f"{cfg.max_num_batched_tokens}, median of {a.rounds} alternating rounds")
    for n in lengths:
        on, off = (statistics.median(times[(n, x)]) for x in (True, False))
        print(f"  {n:>5} tokens: C scores {on * 1e3:7.1f} ms   float32 baddbmm {off * 1e3:7.1f} ms   "
              f"on / off = {on / off:.2f}x")


if __name__ == "__main__":
    main()
