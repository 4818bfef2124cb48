"""``llmd bench`` serving commands: scheduling and caching policies compared on one workload
(throughput, prefix, cascade, chunked-prefill) and load on running daemons (serve, routing)."""

from __future__ import annotations

import asyncio

import click

from llmd.daemon.cli.bench_options import check_ranges
from llmd.daemon.cli.common import build_engine, engine_options, one_line_errors, socket_option, socket_path_of
from llmd.daemon.core.errors import LlmdError


@click.command("throughput")
@click.option("--num-requests", default=32, show_default=True, type=click.IntRange(1))
@click.option("--min-prompt", default=16, show_default=True, type=click.IntRange(1))
@click.option("--max-prompt", default=256, show_default=True, type=click.IntRange(1))
@click.option("--min-output", default=8, show_default=True, type=click.IntRange(1))
@click.option("--max-output", default=128, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, type=int)
@engine_options
@one_line_errors
def bench_throughput(num_requests, min_prompt, max_prompt, min_output, max_output, seed, **engine_kw):
    """Continuous vs static batching on the same seeded mixed-length requests."""
    from llmd.daemon.bench.throughput import run_throughput_bench

    check_ranges(min_prompt=min_prompt, max_prompt=max_prompt, min_output=min_output, max_output=max_output)
    engine = build_engine(**engine_kw)
    run_throughput_bench(engine, num_requests, (min_prompt, max_prompt), (min_output, max_output), seed,
                         echo=click.echo)


@click.command("prefix")
@click.option("--system-tokens", default=1000, show_default=True, type=click.IntRange(1),
              help="System prompt length (tokens).")
@click.option("--users", default=4, show_default=True, type=click.IntRange(1), help="Chats in the sequential scenario.")
@click.option("--turns", default=3, show_default=True, type=click.IntRange(1),
              help="Turns per chat (history resent each turn).")
@click.option("--max-tokens", default=16, show_default=True, type=click.IntRange(1),
              help="New tokens per request (greedy).")
@engine_options
@one_line_errors
def bench_prefix(system_tokens, users, turns, max_tokens, **engine_kw):
    """Median TTFT and prompt tokens computed with prefix caching on vs off (same model, one run)."""
    from llmd.daemon.bench.prefix import run_prefix_bench

    if not engine_kw["enable_prefix_caching"]:  # its "on" engine forces caching on: the flag would do nothing
        raise LlmdError("llmd bench prefix runs with prefix caching on and off itself; drop --no-prefix-caching")
    engine = build_engine(**engine_kw)
    run_prefix_bench(engine, system_tokens, users, turns, max_tokens, echo=click.echo)


@click.command("cascade")
@click.option("--system-tokens", default=1000, show_default=True, type=click.IntRange(1),
              help="Shared system prompt (tokens).")
@click.option("--users", default=32, show_default=True, type=click.IntRange(1), help="Chats queued at once.")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1),
              help="New tokens per request (greedy).")
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1),
              help="Alternating runs per setting; best shown.")
@engine_options
@one_line_errors
def bench_cascade(system_tokens, users, max_tokens, repeats, **engine_kw):
    """Cascade attention on vs off on the shared-prefix workload shape (same model, one run)."""
    from llmd.daemon.bench.cascade import run_cascade_bench

    engine = build_engine(**engine_kw)
    run_cascade_bench(engine, system_tokens, users, max_tokens, repeats, echo=click.echo)


@click.command("chunked-prefill")
@click.option("--num-decoders", default=4, show_default=True, type=click.IntRange(1),
              help="Requests decoding throughout.")
@click.option("--decode-tokens", default=32, show_default=True, type=click.IntRange(1),
              help="Greedy tokens each decoder generates.")
@click.option("--long-prompt", default=1024, show_default=True, type=click.IntRange(1),
              help="Tokens of each periodic long prompt.")
@click.option("--period", default=8, show_default=True, type=click.IntRange(1),
              help="A long prompt every this many decoded tokens.")
@engine_options
@one_line_errors
def bench_chunked_prefill(num_decoders, decode_tokens, long_prompt, period, **engine_kw):
    """ITL of decoding requests while long prompts arrive: chunked prefill on vs off (one run)."""
    from llmd.daemon.bench.chunked import run_chunked_prefill_bench

    engine = build_engine(**engine_kw)
    run_chunked_prefill_bench(engine, num_decoders, decode_tokens, long_prompt, period, echo=click.echo)


@click.command("serve")
@socket_option
@click.option("--num-requests", default=64, show_default=True, type=click.IntRange(1))
@click.option("--rate", default=4.0, show_default=True, type=float, help="Poisson arrival rate, requests/s.")
@click.option("--min-prompt", default=16, show_default=True, type=click.IntRange(1))
@click.option("--max-prompt", default=256, show_default=True, type=click.IntRange(1))
@click.option("--min-output", default=8, show_default=True, type=click.IntRange(1))
@click.option("--max-output", default=128, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, type=int)
@one_line_errors
def bench_serve(socket_path, num_requests, rate, min_prompt, max_prompt, min_output, max_output, seed):
    """Open-loop load on a running daemon: throughput, TTFT, TPOT, ITL p50/p99."""
    from llmd.daemon.bench.serve import run_serve_bench

    if rate <= 0 or num_requests < 1:
        raise LlmdError("--rate must be > 0 and --num-requests >= 1")
    check_ranges(min_prompt=min_prompt, max_prompt=max_prompt, min_output=min_output, max_output=max_output)
    asyncio.run(run_serve_bench(socket_path_of(socket_path), num_requests, rate, (min_prompt, max_prompt),
                                (min_output, max_output), seed, echo=click.echo))


@click.command("routing")
@click.option("--replicas", default=3, show_default=True, type=int, help="llmd serve processes (--threads 1 each).")
@click.option("--users", default=8, show_default=True, type=click.IntRange(1),
              help="Chats at once, each with its own document.")
@click.option("--turns", default=3, show_default=True, type=click.IntRange(1),
              help="Turns per chat (the history resent each turn).")
@click.option("--max-tokens", default=32, show_default=True, type=int, help="New tokens per reply (greedy).")
@click.option("--doc-words", default=None, type=int,
              help="Words of each user's document (default: all 816, ~1,000 SmolLM2 tokens).")
@click.option("--model", "-m", default="smollm2-135m", show_default=True, help="The replicas' --model.")
@click.option("--dtype", default="float32", show_default=True,
              help="The replicas' --dtype (float32: a reply does not depend on the batch it ran in, so both "
                   "policies get the same replies; bfloat16's packs for small steps make it depend).")
@click.option("--kv-cache-memory", default=None, help="The replicas' --kv-cache-memory (default: theirs).")
@one_line_errors
def bench_routing(replicas, users, turns, max_tokens, doc_words, model, dtype, kv_cache_memory):
    """Prefix-cache hit rate of llmd replicas behind vllm-router (loopback): cache_aware vs
    round_robin on a multi-user chat workload, each user with their own long context (one run)."""
    from llmd.daemon.bench.routing import run_routing_bench

    serve_args = ["--model", model, *(["--dtype", dtype] if dtype else []),
                  *(["--kv-cache-memory", kv_cache_memory] if kv_cache_memory else [])]
    run_routing_bench(replicas, users, turns, max_tokens, serve_args, doc_words, echo=click.echo)
