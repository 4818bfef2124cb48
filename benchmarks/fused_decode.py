"""Batch-1 decode: the fused C step (kernels/cpu_fused.py) vs the torch path, side by side.

One engine with SmolLM2 (``--weight-quant auto``, bfloat16, the cpu backend) decodes ``--decode``
greedy tokens after a ``--prompt``-token prompt (a fresh prompt per run: no prefix cache hit),
taking turns between the fused kernel with two-level activations (the default), with one level
(llama.cpp's int8 activations), and the torch path (the runner's fused decoder switched off; the
paged C decode kernel still runs its attention), for ``--rounds`` rounds. Prints each run's
decode tok/s, the best per path and the ratios to the torch path; run ``llama-bench -m <the GGUF>
-t N -p 0 -n 128`` right before or after for the peer's figure.

    python benchmarks/fused_decode.py [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse

from llmd.daemon.bench.single import run_once
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    eng = Engine.from_config(EngineConfig(model=args.model, threads=args.threads))
    runner, fused = eng.runner, eng.runner.fused_decode
    if fused is None:
        raise SystemExit(f"the fused decode path is off: {runner.fused_why_not}")
    vocab = eng.model_config.vocab_size

    def prompt(k: int) -> list[int]:
        return [(i * 7919 + k * 104729) % (vocab - 200) + 100 for i in range(args.prompt)]

    run_once(eng, prompt(0)[:16], 4)  # warm-up
    paths = {"fused, 2 levels": 2, "fused, 1 level": 1, "torch path": None}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    k = 0
    for _ in range(args.rounds):
        for name, levels in paths.items():
            runner.fused_decode = None if levels is None else fused
            fused.model.act_levels = levels or 2
            k += 1
            rates[name].append(run_once(eng, prompt(k), args.decode)[1])
    runner.fused_decode, fused.model.act_levels = fused, 2
    base = max(rates["torch path"])
    print(f"{'path':>16} {'decode tok/s per run':>28} {'best':>7} {'÷ torch path':>13}")
    for name, vals in rates.items():
        print(f"{name:>16} {' '.join(f'{v:6.1f}' for v in vals):>28} {max(vals):7.1f} {max(vals) / base:13.2f}")


if __name__ == "__main__":
    main()
