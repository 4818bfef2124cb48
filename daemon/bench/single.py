"""``llmd bench single``: one stream, per ``--weight-quant`` format, side by side in one run.

For each format the model is loaded (from the same GGUF), then one ``prompt``-token prompt is
prefilled in one step (prefill tok/s) and ``decode`` greedy tokens follow at batch 1 (decode
tok/s, ``ignore_eos``); best of ``repeats``, so a stray process costs a repeat, not the figure.
The same weights and prompts in every row; compare with ``llama-bench -p 512 -n 128 -t N`` run
right before or after (machines of this kind vary ~1.6× day to day).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from llmd.daemon.core.request import SamplingParams


@dataclass
class SingleStreamResult:
    """One format's best prefill and decode rates (tokens/s) and its weight summary line."""

    weight_quant: str
    prefill_tok_s: float
    decode_tok_s: float
    weights: str


def run_once(engine, prompt: list[int], decode: int) -> tuple[float, float]:
    """Prefill ``prompt`` in one step, then ``decode`` tokens; returns (prefill, decode) tok/s."""
    engine.add_request(prompt, SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()  # the whole prompt (the token budget must cover it) and the first token
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), steps / (t2 - t1)


def single_stream(make_engine: Callable[[str], object], formats: list[str], prompt_len: int = 512, decode: int = 128,
                  repeats: int = 3, echo: Callable[[str], None] = print) -> list[SingleStreamResult]:
    """Run :func:`run_once` ``repeats`` times per format (``make_engine(fmt)`` builds each engine)
    and print a table with each row's ratio to the first. Raises ValueError if ``prompt_len``
    exceeds the engine's token budget (the prefill would not be one step)."""
    rows = []
    for fmt in formats:
        engine = make_engine(fmt)
        if prompt_len > engine.config.max_num_batched_tokens:
            raise ValueError(f"--prompt {prompt_len} exceeds the token budget {engine.config.max_num_batched_tokens}")
        vocab = engine.model_config.vocab_size

        def prompt(r: int) -> list[int]:  # a fresh prompt per run: no prefix cache hit
            return [(i * 7919 + r * 104729) % (vocab - 200) + 100 for i in range(prompt_len)]

        run_once(engine, prompt(repeats)[:16], 4)  # warm-up
        best = [max(vals) for vals in zip(*(run_once(engine, prompt(r), decode) for r in range(repeats)))]
        wq = getattr(engine.runner.model, "weight_quant_summary", None)
        rows.append(SingleStreamResult(fmt, best[0], best[1], wq.describe() if wq else "-"))
        del engine
    base = rows[0]
    echo(f"{'weight_quant':>12} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode/first':>12}  weights")
    for r in rows:
        echo(f"{r.weight_quant:>12} {r.prefill_tok_s:14.1f} {r.decode_tok_s:13.1f} "
             f"{r.decode_tok_s / base.decode_tok_s:12.2f}  {r.weights}")
    return rows
