"""``llmd bench chunked-prefill``: steady decoding load plus periodic long prompts; inter-token
latency of the decoding requests with chunked prefill on and off, side by side in one run.

Two engines share one loaded model. "On": the token budget (``max_num_batched_tokens``) and
``max_prefill_chunk`` as configured, so a long prompt is prefilled a chunk per step while the
decodes keep flowing. "Off": budget and chunk large enough for a whole prompt, so the step
that prefills a long prompt carries it entirely and every decode waits for it. Both serve
``num_decoders`` greedy requests generating ``decode_tokens`` each, and one more long prompt
(``long_prompt`` tokens, 4 new tokens) each time the first decoder has produced another
``period`` tokens, so both modes get the same prompts at the same points of the decode. ITL
is measured per decoding request between consecutive tokens (seconds, ``time.perf_counter``).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable

from llmd.daemon.bench.serve import percentile
from llmd.daemon.core.request import SamplingParams


def run_scenario(engine, num_decoders: int, decode_tokens: int, long_prompt: int, period: int, seed: int = 0) -> dict:
    """One engine through the scenario; returns ITL p50/p99/max (ms), steps, long prompts served."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    greedy = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    decoders = [engine.add_request([rng.randrange(100, vocab) for _ in range(32)], dataclasses.replace(greedy))
                for _ in range(num_decoders)]
    last: dict[str, float] = {}
    produced = {r: 0 for r in decoders}
    itl: list[float] = []
    t0 = time.perf_counter()
    longs = steps = 0
    while engine.has_unfinished_requests():
        if produced[decoders[0]] >= (longs + 1) * period and produced[decoders[0]] < decode_tokens:
            engine.add_request([rng.randrange(100, vocab) for _ in range(long_prompt)],
                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            longs += 1
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            if o.request_id in produced and o.new_token_ids:
                produced[o.request_id] += len(o.new_token_ids)
                if o.request_id in last:
                    itl.append(now - last[o.request_id])
                last[o.request_id] = now
    return {"itl_p50_ms": 1000 * percentile(itl, 50), "itl_p99_ms": 1000 * percentile(itl, 99),
            "itl_max_ms": 1000 * max(itl, default=0.0), "steps": steps, "long_prompts": longs,
            "seconds": time.perf_counter() - t0}


def run_chunked_prefill_bench(engine, num_decoders: int = 4, decode_tokens: int = 32, long_prompt: int = 1024,
                              period: int = 8, echo: Callable[[str], None] = print) -> dict[bool, dict]:
    """Run the scenario with chunked prefill on and off; print ITL percentiles and the p99 ratio."""
    from llmd.daemon.core.engine import Engine

    cfg = engine.config
    big = max(cfg.max_num_batched_tokens, long_prompt + num_decoders + 1)
    configs = {True: cfg, False: dataclasses.replace(cfg, max_num_batched_tokens=big, max_prefill_chunk=big)}
    echo(f"{num_decoders} requests decoding {decode_tokens} greedy tokens; a {long_prompt}-token prompt arrives every "
         f"{period} decoded tokens; chunked: budget {cfg.max_num_batched_tokens}, chunk {cfg.max_prefill_chunk}; "
         f"unchunked: {big}; {cfg.device} {cfg.dtype}")
    out = {}
    for on, c in configs.items():
        eng = Engine(engine.runner.model, engine.tokenizer, dataclasses.replace(c, enable_prefix_caching=False))
        r = run_scenario(eng, num_decoders, decode_tokens, long_prompt, period)
        out[on] = r
        echo(f"chunked prefill {'on ' if on else 'off'}: ITL p50 {r['itl_p50_ms']:8.1f} ms  "
             f"p99 {r['itl_p99_ms']:8.1f} ms  max {r['itl_max_ms']:8.1f} ms; {r['long_prompts']} long prompts, "
             f"{r['steps']} steps, {r['seconds']:.0f} s")
    echo(f"ITL p99 off / on: {out[False]['itl_p99_ms'] / max(1e-9, out[True]['itl_p99_ms']):.2f}x")
    return out
