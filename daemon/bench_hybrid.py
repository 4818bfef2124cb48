"""``llmd bench hybrid``: concurrent long sequences in one KV budget, with the hybrid KV cache
groups (sliding-window layers free out-of-window blocks) vs every layer kept global.

Two engines share one loaded model and one ``--kv-cache-memory``; only
``disable_hybrid_kv_cache_manager`` differs. Each is given more ``seq_tokens``-token requests
(a short prompt + ``max_tokens`` up to ``seq_tokens``) than can fit, runs ``steps`` steps, and
the number of sequences running at once is counted — the scheduler admits a request only
when its peak KV blocks (the window bound for sliding groups) fit, so every admitted
sequence can run to its end without preemption. Then everything is aborted.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from llmd.daemon.kv_size import blocks_per_sequence
from llmd.daemon.request import SamplingParams


def measure_concurrency(engine, seq_tokens: int, num_requests: int, steps: int, seed: int = 0) -> tuple[int, int]:
    """Queue ``num_requests`` sequences of ``seq_tokens`` tokens and run ``steps`` steps.

    Returns:
        (most sequences running at once, KV blocks in use at that point).
    """
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompt_len = min(32, seq_tokens - 1)
    rids = []
    for _ in range(num_requests):
        prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
        sp = SamplingParams(max_tokens=seq_tokens - prompt_len, temperature=0.0, ignore_eos=True)
        rids.append(engine.add_request(prompt, sp))
    best = used = 0
    for _ in range(steps):
        engine.step()
        engine.kv_manager.check_integrity()
        if len(engine.scheduler.running) >= best:
            best, used = len(engine.scheduler.running), engine.kv_manager.num_used_blocks
    for rid in rids:
        engine.abort(rid)
    return best, used


def run_hybrid_bench(engine, seq_tokens: int = 2048, echo: Callable[[str], None] = print) -> dict[bool, int]:
    """Measure concurrency with and without hybrid KV cache groups; print both and the ratio.

    Returns:
        ``{hybrid: sequences running at once}``.
    """
    from llmd.daemon.engine import Engine

    out: dict[bool, int] = {}
    cfg = engine.config
    for hybrid in (True, False):
        eng = Engine(engine.runner.model, engine.tokenizer, dataclasses.replace(
            cfg, disable_hybrid_kv_cache_manager=not hybrid, max_num_seqs=4096, kv_cache_memory=engine.kv_cache_memory))
        groups = eng.kv_cache_groups
        per_seq = sum(g.max_blocks(seq_tokens, cfg.block_size, cfg.max_num_batched_tokens) for g in groups)
        fits = (eng.num_blocks - 1) // per_seq
        n = min(512, fits + 2)
        steps = -(-n * min(32, seq_tokens - 1) // cfg.max_num_batched_tokens) + 2  # enough to admit them all
        running, used = measure_concurrency(eng, seq_tokens, n, steps)
        out[hybrid] = running
        label = "hybrid groups" if hybrid else "all global   "
        echo(f"{label}: {len(groups)} KV cache group(s), {eng.num_blocks - 1} blocks of {eng.block_bytes} B, "
             f"peak {per_seq} blocks per {seq_tokens}-token sequence (decode alone: "
             f"{blocks_per_sequence(groups, seq_tokens, cfg.block_size, 1)}); {running} sequences running at once "
             f"({used} blocks in use after {steps} steps)")
    echo(f"model {engine.model_config.name}, KV budget {engine.kv_cache_memory / 2**20:.0f} MiB, {cfg.dtype}, "
         f"token budget {cfg.max_num_batched_tokens}: hybrid / all-global concurrent sequences = "
         f"{out[True] / max(1, out[False]):.2f}x ({out[True]} vs {out[False]})")
    return out
