"""``llmd bench prefix``: prefix caching on vs off, side by side in one process.

Two engines share one loaded model (same runner code, same token budget); one caches
prefixes, the other does not. Both serve the same greedy workload:

* sequential: ``users`` multi-turn chats, each turn = a ~1,000-token system prompt + the
  chat's history (earlier questions and the model's own answers) + a new question, sent one
  after another (the next turn waits for the answer);
* concurrent: ``users × turns`` different questions after the same system prompt, all sent at
  once, on a cold cache (the prefix cache is reset first).

Per scenario it prints the median TTFT (seconds from ``add_request`` to the first token) and
the prompt tokens the model actually computed, with and without caching, and their ratios.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmd.daemon.core.request import SamplingParams

SYSTEM_PROMPT = (
    "You are llmd's assistant. You answer questions about cooking, travel and science in short, "
    "plain sentences. You never invent facts; when unsure you say so. Keep every answer under "
    "three sentences, avoid lists unless asked, and prefer metric units. "
)
QUESTIONS = [
    "How long should I boil an egg?", "What is the capital of Japan?", "Why is the sea salty?",
    "How do I keep basil fresh?", "What causes thunder?", "Is it safe to drink tap water in Oslo?",
    "How far is the Moon?", "What is a good substitute for butter?", "Why do onions make me cry?",
    "When is the best time to visit Lisbon?", "What is photosynthesis?", "How do I sharpen a knife?",
]


@dataclass
class ScenarioResult:
    """One scenario on one engine: per-request TTFTs (seconds) and prompt tokens computed."""

    ttfts: list[float]
    prefill_tokens: int

    @property
    def median_ttft(self) -> float:
        return statistics.median(self.ttfts)


def system_prompt_ids(tokenizer, num_tokens: int) -> list[int]:
    """A system prompt of exactly ``num_tokens`` tokens (the text repeated and cut)."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(SYSTEM_PROMPT)
    return ids[:num_tokens]


def serve(engine, prompts: list[list[int]], max_tokens: int,
          decode_steps: list[float] | None = None) -> tuple[list[float], list[list[int]], int]:
    """Queue ``prompts`` together and run to completion, greedy, EOS ignored: (TTFTs in s,
    outputs, prefill tokens). ``decode_steps``: if given, the seconds of every step that ran
    decodes only are appended to it."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, dataclasses.replace(sp)) for p in prompts]
    first: dict[str, float] = {}
    outs: dict[str, list[int]] = {r: [] for r in rids}
    prefill = 0
    while engine.has_unfinished_requests():
        t_step = time.perf_counter()
        step_out = engine.step()
        now = time.perf_counter()
        sched = engine.last_scheduler_output.scheduled
        step_prefill = sum(s.num_new_tokens for s in sched if s.is_prefill)
        prefill += step_prefill
        if decode_steps is not None and sched and not step_prefill:
            decode_steps.append(now - t_step)
        for o in step_out:
            outs[o.request_id] += o.new_token_ids
            first.setdefault(o.request_id, now - t0)
    return [first[r] for r in rids], [outs[r] for r in rids], prefill


def run_sequential(engine, system: list[int], users: int, turns: int, max_tokens: int) -> ScenarioResult:
    """Multi-turn chats sent one request at a time; each turn resends the whole history."""
    tok = engine.tokenizer
    ttfts, prefill = [], 0
    for u in range(users):
        history = list(system)
        for t in range(turns):
            q = tok.encode(f"\nUser: {QUESTIONS[(u * turns + t) % len(QUESTIONS)]}\nAssistant:")
            [ttft], [answer], p = serve(engine, [history + q], max_tokens)
            ttfts.append(ttft)
            prefill += p
            history += q + answer
    return ScenarioResult(ttfts, prefill)


def run_concurrent(engine, system: list[int], users: int, max_tokens: int) -> ScenarioResult:
    """``users`` questions after the same system prompt, queued at once."""
    tok = engine.tokenizer
    prompts = [system + tok.encode(f"\nUser: {QUESTIONS[i % len(QUESTIONS)]}\nAssistant:") for i in range(users)]
    ttfts, _, prefill = serve(engine, prompts, max_tokens)
    return ScenarioResult(ttfts, prefill)


def run_prefix_bench(engine, system_tokens: int = 1000, users: int = 4, turns: int = 3, max_tokens: int = 16,
                     echo: Callable[[str], None] = print) -> dict[str, dict[bool, ScenarioResult]]:
    """Run both scenarios with prefix caching on (``engine``'s own setting forced on) and off
    (a second engine on the same model), print the table and ratios; returns the results
    keyed by scenario then caching flag."""
    from llmd.daemon.core.engine import Engine

    cfg = engine.config
    engines = {
        True: Engine(engine.runner.model, engine.tokenizer, dataclasses.replace(cfg, enable_prefix_caching=True)),
        False: Engine(engine.runner.model, engine.tokenizer, dataclasses.replace(cfg, enable_prefix_caching=False)),
    }
    system = system_prompt_ids(engine.tokenizer, system_tokens)
    serve(engines[False], [system[:64]], 2)  # warm-up outside the timed runs
    results: dict[str, dict[bool, ScenarioResult]] = {"sequential": {}, "concurrent": {}}
    for on, eng in engines.items():
        results["sequential"][on] = run_sequential(eng, system, users, turns, max_tokens)
        eng.reset_prefix_cache()  # cold start: the sharing must happen among the concurrent requests
        results["concurrent"][on] = run_concurrent(eng, system, users * turns, max_tokens)
    echo(f"workload: {system_tokens}-token system prompt; sequential = {users} chats x {turns} turns (history resent), "
         f"concurrent = {users * turns} requests at once; {max_tokens} new tokens each, greedy; "
         f"token budget {cfg.max_num_batched_tokens}, {cfg.device} {cfg.dtype}, block size {cfg.block_size}")
    for name, by_flag in results.items():
        on, off = by_flag[True], by_flag[False]
        for label, r in (("caching off:", off), ("caching on: ", on)):
            echo(f"{name:<11} {label} median TTFT {r.median_ttft:.3f} s, prompt tokens computed {r.prefill_tokens}")
        echo(f"{name:<11} median TTFT off / on: {off.median_ttft / on.median_ttft:.2f}x; "
             f"prompt tokens off / on: {off.prefill_tokens / max(1, on.prefill_tokens):.2f}x")
    kv = engines[True].kv_manager
    echo(f"prefix cache (on): {kv.prefix_cache_hits} of {kv.prefix_cache_queries} prompt tokens hit "
         f"({kv.prefix_cache_hits / max(1, kv.prefix_cache_queries):.0%})")
    return results
