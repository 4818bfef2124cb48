"""``llmd bench hybrid``: long sequences decoding at once in one KV budget, with the hybrid KV
cache groups (sliding-window layers free out-of-window blocks) vs every layer kept global.

Two engines share one loaded model and one ``--kv-cache-memory``; only
``disable_hybrid_kv_cache_manager`` differs. Both run the same requests to completion:
``num_requests`` distinct random prompts of ``seq_tokens - new_tokens`` tokens, each then
generating ``new_tokens`` greedy tokens (no shared prefixes). The figure is the most
sequences that were decoding at once, i.e. held the KV of ~``seq_tokens`` tokens at the same
time; when the pool runs dry the scheduler preempts (counted), so the all-global layout ends
up running fewer sequences side by side.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable

from llmd.daemon.core.kv_size import blocks_per_sequence
from llmd.daemon.core.request import SamplingParams


def measure_concurrency(engine, seq_tokens: int, num_requests: int, new_tokens: int, seed: int = 0) -> dict:
    """Run the requests to completion; returns ``{"decoding": most sequences decoding at once,
    "preemptions": count, "seconds": wall time, "steps": steps}``."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    for _ in range(num_requests):
        prompt = [rng.randrange(100, vocab) for _ in range(seq_tokens - new_tokens)]
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    best = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv_manager.check_integrity()
        steps += 1
        best = max(best, sum(1 for r in engine.scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens))
    return {"decoding": best, "preemptions": engine.scheduler.num_preemptions, "seconds": time.perf_counter() - t0,
            "steps": steps}


def run_hybrid_bench(engine, seq_tokens: int = 2048, new_tokens: int = 16, num_requests: int | None = None,
                     echo: Callable[[str], None] = print) -> dict[bool, dict]:
    """Measure with and without hybrid KV cache groups; print both and the ratio.

    ``num_requests`` defaults to one more than the hybrid layout's decode bound fits.
    Returns ``{hybrid: measure_concurrency(...) result}``.
    """
    from llmd.daemon.core.engine import Engine

    cfg = engine.config
    engines = {h: Engine(engine.runner.model, engine.tokenizer, dataclasses.replace(
        cfg, disable_hybrid_kv_cache_manager=not h, kv_cache_memory=engine.kv_cache_memory, max_num_seqs=256))
        for h in (True, False)}
    fits = {h: (e.num_blocks - 1) // blocks_per_sequence(e.kv_cache_groups, seq_tokens, cfg.block_size, 1)
            for h, e in engines.items()}
    n = num_requests or fits[True] + 1
    echo(f"model {engine.model_config.name}, KV budget {engine.kv_cache_memory / 2**20:.0f} MiB, {cfg.dtype}, "
         f"block size {cfg.block_size}, token budget {cfg.max_num_batched_tokens}; {n} requests of "
         f"{seq_tokens - new_tokens} prompt + {new_tokens} new tokens")
    out = {}
    for hybrid, eng in engines.items():
        res = measure_concurrency(eng, seq_tokens, n, new_tokens)
        out[hybrid] = res
        per_seq = blocks_per_sequence(eng.kv_cache_groups, seq_tokens, cfg.block_size, 1)
        echo(f"{'hybrid groups' if hybrid else 'all global   '}: {len(eng.kv_cache_groups)} KV cache group(s), "
             f"{eng.num_blocks - 1} blocks of {eng.block_bytes} B, {per_seq} blocks per {seq_tokens}-token sequence "
             f"in decode ({fits[hybrid]} fit); {res['decoding']} sequences decoding at once, "
             f"{res['preemptions']} preemptions, {res['steps']} steps, {res['seconds']:.0f} s")
    ratio = out[True]["decoding"] / max(1, out[False]["decoding"])
    echo(f"hybrid / all-global sequences decoding at once: {ratio:.2f}x "
         f"({out[True]['decoding']} vs {out[False]['decoding']})")
    return out
