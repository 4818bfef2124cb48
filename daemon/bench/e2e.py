"""End-to-end offline throughput on nano-vllm's benchmark workload (the GPU script's ``e2e`` step).

``python -m llmd.daemon.bench.e2e --model random:qwen3-0.6b`` builds the engine in-process (no
daemon, no click) and runs nano-vllm's ``bench.py`` workload: ``--requests`` (256) prompts of
random token ids with prompt and output lengths drawn from U[``--min-len``, ``--max-len``]
(100..1,024), ``ignore_eos`` so every request produces exactly its drawn number of tokens,
temperature 0.6, ``--max-num-seqs 256``, ``--max-model-len 4096`` (nano-vllm's setting; it also
fixes the CUDA-graph decode's split count, ``llmd.daemon.core.cuda_graphs``). Requests come from
:func:`llmd.daemon.bench.throughput.make_workload` (seeded). Prints output tok/s, and per
decode-only step its host time: wall time minus the time the runner waited in one
``torch.cuda.synchronize`` after the forward and the logits (``ModelRunner.measure_device_wait``;
the sampler's device time counts as host time, so this is an upper bound; 0 wait on CPU).

Exit code 1 when ``--target-tok-s`` or ``--max-host-ms`` (0 = no check) is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from llmd.daemon.bench.throughput import make_workload
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.request import SamplingParams


def run_e2e(engine: Engine, requests: int, lengths: tuple[int, int], seed: int = 0,
            temperature: float = 0.6) -> dict:
    """Run the workload through ``engine``; returns ``{"output_tokens", "expected_tokens", "seconds", "tok_per_s",
    "steps", "decode_steps", "host_ms_p50", "host_ms_p90", "graph_replays"}`` (host times over
    decode-only steps, ms; NaN when there was none)."""
    work = make_workload(requests, lengths, lengths, seed, engine.model_config.vocab_size)
    cuda = engine.config.device.startswith("cuda")
    for prompt, _ in work[:2]:  # warm-up: allocator, cuBLAS, sampler kernels
        engine.add_request(prompt[:16], SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for i, (prompt, max_tokens) in enumerate(work):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i,
                                                  ignore_eos=True))
    runner = engine.runner
    runner.measure_device_wait = True
    graphs = runner.decode_graphs
    replays0 = graphs.replays if graphs is not None else 0
    host, tokens, steps = [], 0, 0
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        wait0, s0 = runner.device_wait_s, time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        sched = engine.last_scheduler_output
        if sched and all(len(s.token_ids) == 1 for s in sched.scheduled):
            host.append(1e3 * (dt - (runner.device_wait_s - wait0)))
        tokens += sum(len(o.new_token_ids) for o in outs)
        steps += 1
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    runner.measure_device_wait = False
    pct = statistics.quantiles(host, n=10) if len(host) >= 2 else [float("nan")] * 9
    return {"output_tokens": tokens, "expected_tokens": sum(m for _, m in work), "seconds": seconds,
            "tok_per_s": tokens / seconds, "steps": steps,
            "decode_steps": len(host), "host_ms_p50": statistics.median(host) if host else float("nan"),
            "host_ms_p90": pct[8], "graph_replays": (graphs.replays - replays0) if graphs is not None else 0}


def graph_agreement(engine: Engine, requests: int = 8, prompt_len: int = 64, output_len: int = 16,
                    seed: int = 1) -> float | None:
    """Greedy tokens of ``requests`` prompts with the decode graphs vs with every step eager
    (same engine and weights): the share of identical tokens, None without graphs. On CUDA the
    two can differ (cuBLAS picks kernels by batch shape: the graph's padded bucket vs the real
    batch), so this is reported, not required to be 1."""
    runner = engine.runner
    graphs = runner.decode_graphs
    if graphs is None:
        return None
    work = make_workload(requests, (prompt_len, prompt_len), (output_len, output_len), seed,
                         engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with_graphs = engine.generate([p for p, _ in work], params)
    runner.decode_graphs = None
    try:
        eager = engine.generate([p for p, _ in work], params)
    finally:
        runner.decode_graphs = graphs
    pairs = [(a, b) for x, y in zip(with_graphs, eager) for a, b in zip(x["token_ids"], y["token_ids"])]
    return sum(a == b for a, b in pairs) / len(pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: the engine's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-tok-s", type=float, default=0.0)
    ap.add_argument("--max-host-ms", type=float, default=0.0)
    a = ap.parse_args(argv)
    config = EngineConfig(model=a.model, device=a.device, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
                          max_model_len=a.max_model_len, kv_cache_memory=a.kv_cache_memory,
                          gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
                          enable_prefix_caching=False, prefix_cache_seed=0)
    t0 = time.perf_counter()
    engine = Engine.from_config(config)
    graphs = engine.runner.decode_graphs
    print(f"{engine.model_config.name}: {engine.runtime_summary()}; {engine.capacity_summary()}; "
          f"CUDA graphs: {len(graphs.graphs) if graphs else 0} batch sizes; built in {time.perf_counter() - t0:.1f} s")
    agree = graph_agreement(engine)
    if agree is not None:
        print(f"greedy tokens, CUDA graphs vs eager (8 requests x 16 tokens): {100 * agree:.1f}% identical")
    r = run_e2e(engine, a.requests, (a.min_len, a.max_len), a.seed)
    print(f"workload: {a.requests} requests, prompt and output lengths U[{a.min_len}, {a.max_len}], ignore_eos, "
          f"max_num_seqs {engine.config.max_num_seqs}, max_model_len {engine.max_model_len}")
    print(f"output: {r['output_tokens']} tokens in {r['seconds']:.2f} s = {r['tok_per_s']:.1f} output tok/s, "
          f"{r['steps']} steps")
    print(f"decode steps: {r['decode_steps']}, {r['graph_replays']} CUDA-graph replays; host time per decode step "
          f"p50 {r['host_ms_p50']:.2f} ms, p90 {r['host_ms_p90']:.2f} ms (target <= 2 ms on a GPU)")
    ok = r["output_tokens"] == r["expected_tokens"]  # ignore_eos: every request ran to its drawn length
    if not ok:
        print(f"FAIL: {r['output_tokens']} output tokens, the workload draws {r['expected_tokens']}")
    if a.target_tok_s and r["tok_per_s"] < a.target_tok_s:
        print(f"FAIL: {r['tok_per_s']:.1f} < target {a.target_tok_s} output tok/s")
        ok = False
    if a.max_host_ms and not r["host_ms_p50"] <= a.max_host_ms:
        print(f"FAIL: host time p50 {r['host_ms_p50']:.2f} ms > {a.max_host_ms} ms")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
