"""``llmd bench prefix`` (and later bench commands), registered on the ``bench`` group of
:mod:`llmd.daemon.cli.main`, which passes its shared helpers in so this module never imports it."""

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
        from llmd.daemon.bench.prefix import run_prefix_bench

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
        from llmd.daemon.bench.hybrid import run_hybrid_bench

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
        from llmd.daemon.bench.chunked import run_chunked_prefill_bench

        engine = build_engine(**engine_kw)
        run_chunked_prefill_bench(engine, num_decoders, decode_tokens, long_prompt, period, echo=click.echo)

    def int_list(ctx, param, value):
        try:
            out = [int(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"comma-separated integers expected, got {value!r}") from None
        if not out or min(out) < 1:
            raise click.BadParameter(f"positive integers expected, got {value!r}")
        return out

    def name_list(ctx, param, value):
        return [x.strip() for x in value.split(",") if x.strip()]

    # bench step takes --dtype / --attention-backend as lists, sizes the KV pool itself and
    # bypasses the scheduler, so those engine options are left off (the rest apply as usual)
    not_for_step = {"dtype", "attention_backend", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                    "max_model_len", "enable_prefix_caching", "prefix_cache_seed", "max_prefill_chunk", "max_num_waiting"}

    def step_engine_options(fn):
        fn = engine_options(fn)
        fn.__click_params__ = [p for p in fn.__click_params__ if p.name not in not_for_step]
        return fn

    @bench.command("step")
    @click.option("--batch", default="1,8,32,64", show_default=True, callback=int_list, help="Batch sizes (decoding sequences), comma-separated.")
    @click.option("--context", default="256,1024", show_default=True, callback=int_list, help="Tokens cached per sequence, comma-separated.")
    @click.option("--dtype", "dtypes", default="float32,bfloat16", show_default=True, callback=name_list, help="Model dtypes, comma-separated (weights loaded once each).")
    @click.option("--attention-backend", "backends", default="torch,cpu", show_default=True, callback=name_list, help="Attention backends, comma-separated (torch = the reference).")
    @click.option("--reps", default=5, show_default=True, type=click.IntRange(min=1), help="Timed repetitions per component (median; after one warm-up).")
    @click.option("--bandwidth-mib", default=512, show_default=True, type=click.IntRange(min=1), help="Tensor size of the read-bandwidth measurement (MiB).")
    @step_engine_options
    @one_line_errors
    def bench_step(batch, context, dtypes, backends, reps, bandwidth_mib, **engine_kw):
        """Per-step time of decode steps split into preparation, linears, lm_head, attention and
        sampling, beside the linears-only and KV-read floors (the KV pool is sized to fit)."""
        from llmd.daemon.bench.step import run_step_bench

        run_step_bench(engine_kw, dtypes, backends, batch, context, reps, bandwidth_mib, echo=click.echo)
