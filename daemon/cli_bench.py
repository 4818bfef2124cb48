"""``llmd bench prefix`` (and later bench commands), registered on the ``bench`` group of
:mod:`llmd.daemon.cli`, which passes its shared helpers in so this module never imports it."""

from __future__ import annotations

import click


def register(bench, engine_options, one_line_errors, build_engine) -> None:
    """Add the commands of this module to the ``bench`` click group."""

    @bench.command("prefix")
    @click.option("--system-tokens", default=1000, show_default=True, type=int, help="System prompt length (tokens).")
    @click.option("--users", default=4, show_default=True, type=int, help="Chats in the sequential scenario.")
    @click.option("--turns", default=3, show_default=True, type=int, help="Turns per chat (history resent each turn).")
    @click.option("--max-tokens", default=16, show_default=True, type=int, help="New tokens per request (greedy).")
    @engine_options
    @one_line_errors
    def bench_prefix(system_tokens, users, turns, max_tokens, **engine_kw):
        """Median TTFT and prompt tokens computed with prefix caching on vs off (same model, one run)."""
        from llmd.daemon.bench_prefix import run_prefix_bench

        engine = build_engine(**engine_kw)
        run_prefix_bench(engine, system_tokens, users, turns, max_tokens, echo=click.echo)

    @bench.command("hybrid")
    @click.option("--seq-tokens", default=2048, show_default=True, type=int, help="Tokens per sequence (prompt + new).")
    @click.option("--new-tokens", default=16, show_default=True, type=int, help="Greedy tokens generated per sequence.")
    @click.option("--num-requests", default=None, type=int, help="Sequences (default: one more than the hybrid layout fits).")
    @engine_options
    @one_line_errors
    def bench_hybrid(seq_tokens, new_tokens, num_requests, **engine_kw):
        """Long sequences decoding at once in one KV budget: hybrid KV cache groups vs every layer
        global (use a model with sliding-window layers: --model gemma3-270m)."""
        from llmd.daemon.bench_hybrid import run_hybrid_bench

        engine = build_engine(**engine_kw)
        run_hybrid_bench(engine, seq_tokens, new_tokens, num_requests, echo=click.echo)

    @bench.command("chunked-prefill")
    @click.option("--num-decoders", default=4, show_default=True, type=int, help="Requests decoding throughout.")
    @click.option("--decode-tokens", default=32, show_default=True, type=int, help="Greedy tokens each decoder generates.")
    @click.option("--long-prompt", default=1024, show_default=True, type=int, help="Tokens of each periodic long prompt.")
    @click.option("--period", default=8, show_default=True, type=int, help="A long prompt every this many decoded tokens.")
    @engine_options
    @one_line_errors
    def bench_chunked_prefill(num_decoders, decode_tokens, long_prompt, period, **engine_kw):
        """ITL of decoding requests while long prompts arrive: chunked prefill on vs off (one run)."""
        from llmd.daemon.bench_chunked import run_chunked_prefill_bench

        engine = build_engine(**engine_kw)
        run_chunked_prefill_bench(engine, num_decoders, decode_tokens, long_prompt, period, echo=click.echo)
