"""``llmd bench cascade``: cascade attention on vs off (``--disable-cascade-attn``), side by side
in one process.

Two engines share one loaded model and every setting but the flag. Each serves the peers'
shared-prefix shape: ``users`` chats queued at once, each a ``system_tokens``-token system
prompt plus its own question, ``max_tokens`` greedy tokens each (EOS ignored). The token budget
admits them a few at a time, so the later ones hit the prefix cache and their block tables share
the system prompt's blocks — what cascade attention (:mod:`llmd.kernels.cpu_cascade`) uses.
Per engine: wall time, output tok/s, median decode-only step (ms; the steps where every
scheduled request decodes), best of ``repeats`` runs alternating on/off so drift hits both; and
whether both produced the same tokens (they should in float32; bfloat16 may differ in the last
bits of a logit, so a greedy token can flip).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmd.daemon.bench.prefix import QUESTIONS, serve, system_prompt_ids


@dataclass
class CascadeRun:
    """One run: wall seconds, output tokens, decode-only step times (s), outputs per request."""

    wall_s: float
    output_tokens: int
    decode_steps: list[float]
    outputs: list[list[int]]

    @property
    def out_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_step_ms(self) -> float:
        return 1e3 * statistics.median(self.decode_steps) if self.decode_steps else float("nan")


def serve_once(engine, prompts: list[list[int]], max_tokens: int) -> CascadeRun:
    """Queue ``prompts`` at once on a cold prefix cache and run them to completion
    (:func:`llmd.daemon.bench.prefix.serve`)."""
    engine.reset_prefix_cache()
    steps: list[float] = []
    t0 = time.perf_counter()
    _, outs, _ = serve(engine, prompts, max_tokens, decode_steps=steps)
    wall = time.perf_counter() - t0
    return CascadeRun(wall, sum(len(o) for o in outs), steps, outs)


def run_cascade_bench(engine, system_tokens: int = 1000, users: int = 32, max_tokens: int = 32, repeats: int = 2,
                      echo: Callable[[str], None] = print) -> dict[bool, CascadeRun]:
    """Best of ``repeats`` alternating runs per setting; prints the table; returns the best runs
    keyed by "cascade on"."""
    from llmd.daemon.core.engine import Engine

    cfg = engine.config
    engines = {on: Engine(engine.runner.model, engine.tokenizer,
                          dataclasses.replace(cfg, disable_cascade_attn=not on, enable_prefix_caching=True))
               for on in (True, False)}
    tok = engine.tokenizer
    system = system_prompt_ids(tok, system_tokens)
    prompts = [system + tok.encode(f"\nUser: {QUESTIONS[i % len(QUESTIONS)]} ({i})\nAssistant:") for i in range(users)]
    serve_once(engines[True], prompts[:2], 2)  # warm-up outside the timed runs
    best: dict[bool, CascadeRun] = {}
    for _ in range(repeats):
        for on, eng in engines.items():
            r = serve_once(eng, prompts, max_tokens)
            if on not in best or r.wall_s < best[on].wall_s:
                best[on] = r
    echo(f"workload: {users} chats at once on a {system_tokens}-token system prompt, {max_tokens} greedy tokens each; "
         f"{cfg.device} {cfg.dtype}, attention {cfg.attention_backend}, max {cfg.max_num_seqs} seqs, "
         f"budget {cfg.max_num_batched_tokens}; best of {repeats} alternating runs")
    for on in (False, True):
        r = best[on]
        echo(f"cascade {'on ' if on else 'off'}: wall {r.wall_s:.2f} s, {r.out_tok_s:.1f} out tok/s, "
             f"median decode step {r.decode_step_ms:.1f} ms over {len(r.decode_steps)} decode-only steps")
    on, off = best[True], best[False]
    echo(f"on / off: out tok/s {on.out_tok_s / off.out_tok_s:.2f}x, "
         f"decode step {on.decode_step_ms / off.decode_step_ms:.2f}x; same tokens: {on.outputs == off.outputs}")
    return best
