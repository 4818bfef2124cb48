"""``llmd bench`` KV cache commands: quality per KV dtype (kv-quality, context-shift), blocks
held (hybrid, beam) and KV moved between daemons (kv-transfer)."""

from __future__ import annotations

import time

import click

from llmd.daemon.cli.bench_options import int_list
from llmd.daemon.cli.common import build_engine, engine_options, one_line_errors
from llmd.daemon.core.errors import LlmdError


@click.command("kv-quality")
@click.option("--chunk", default=64, show_default=True, type=click.IntRange(1),
              help="Teacher-forcing chunk (tokens); store-then-read.")
@click.option("--hf-reference", is_flag=True,
              help="Also run HF transformers with fake-quantized K/V (loads the HF model, in --dtype).")
@click.option("--cached-prefix", default=0, show_default=True, type=int,
              help="Serve this many leading tokens from the prefix cache (a first request computes them); 0 = off.")
@click.option("--text", "text_name", type=click.Choice(["short", "long"]), default="short", show_default=True,
              help="short: the ~1,000-token Q1/Q4 text; long: it plus original prose (>= 2,000 tokens).")
@click.option("--jitter-runs", default=0, show_default=True, type=int,
              help="Report ΔNLL/top-1 as mean ± sd over N runs, each with the float32 embedding table "
                   "jittered by a relative 1e-6 (needs --dtype float32); 0 = one plain run.")
@click.option("--scale-groups", default=None,
              help="Comma list of --kv-scale-group-size values for the 8-bit rows, e.g. 0,32 "
                   "(default: --kv-scale-group-size).")
@engine_options
@one_line_errors
def bench_kv_quality(chunk, hf_reference, cached_prefix, text_name, jitter_runs, scale_groups, kv_cache_dtype,
                     **engine_kw):
    """Teacher-forced ΔNLL and top-1 agreement per KV dtype on a fixed text (cases Q1/Q4; --text long: >= 2,000 tokens).

    Every quantized dtype runs without and with --kv-rotation hadamard unless --kv-rotation is
    given; --kv-cache-dtype other than auto keeps only that dtype's rows (and the auto base)."""
    from llmd.daemon.bench.kv_quality import BENCH_KV_DTYPES, ROTATIONS, format_table, hf_reference_table, kv_quality
    from llmd.daemon.bench.kv_quality_text import LONG_QUALITY_TEXT, QUALITY_TEXT

    if jitter_runs < 0:
        raise LlmdError(f"--jitter-runs must be >= 0, got {jitter_runs}")
    if jitter_runs and engine_kw.get("dtype") != "float32":
        raise LlmdError("--jitter-runs needs --dtype float32 (a 1e-6 jitter rounds away in 16 bits)")
    if jitter_runs and hf_reference:
        raise LlmdError("--jitter-runs and --hf-reference: choose one (the HF reference is not jittered)")

    kv_scales = engine_kw.pop("kv_scales", None)  # for the quantized rows (the first engine is auto)
    rotation = engine_kw.pop("kv_rotation", None)
    rotations = ROTATIONS if rotation is None else (rotation,)
    group = engine_kw.pop("kv_scale_group_size", 0)  # for the 8-bit rows (the first engine is auto)
    try:
        groups = tuple(int(g) for g in scale_groups.split(",")) if scale_groups else (group,)
    except ValueError:
        raise LlmdError(f"--scale-groups must be a comma list of integers, got {scale_groups!r}") from None
    kv_dtypes = BENCH_KV_DTYPES if kv_cache_dtype == "auto" else ("auto", kv_cache_dtype)
    if kv_scales is not None:  # static scales exist for the 8-bit formats only
        kv_dtypes = tuple(n for n in kv_dtypes if n != "int4")
    from llmd.daemon.core.config import EngineConfig

    for g in groups:  # static scales and scale groups fail before the weights load
        EngineConfig(device=engine_kw.get("device") or "cpu", kv_cache_dtype="int8", kv_scale_group_size=g,
                     kv_scales=kv_scales, attention_backend=engine_kw.get("attention_backend")).resolve()
    if cached_prefix < 0:
        raise LlmdError(f"--cached-prefix must be >= 0 tokens, got {cached_prefix}")
    engine = build_engine(**engine_kw)
    ids = engine.input_processor.tokenize(LONG_QUALITY_TEXT if text_name == "long" else QUALITY_TEXT)
    kw = {k: getattr(engine.config, k)
          for k in ("device", "dtype", "block_size", "kv_cache_memory", "attention_backend", "threads")}
    t0 = time.monotonic()
    if not 0 <= cached_prefix < len(ids):
        raise LlmdError(f"--cached-prefix must be in [0, {len(ids)}) tokens, got {cached_prefix}")
    if cached_prefix and not engine.config.enable_prefix_caching:
        raise LlmdError("--cached-prefix needs prefix caching (drop --no-prefix-caching)")
    if jitter_runs:
        from llmd.daemon.bench.kv_quality_runs import format_stats
        from llmd.daemon.bench.kv_quality_runs import jitter_runs as run_jittered

        stats = run_jittered(engine.runner.model, engine.tokenizer, ids, jitter_runs, kv_dtypes=kv_dtypes, chunk=chunk,
                             cached_prefix=cached_prefix, kv_scales=kv_scales, rotations=rotations,
                             scale_groups=groups, **kw)
        table = format_stats(stats)
    else:
        rows = kv_quality(engine.runner.model, engine.tokenizer, ids, kv_dtypes, chunk, cached_prefix, kv_scales,
                          rotations, groups, **kw)
        table = format_table(rows)
    bs = engine.config.block_size
    served = f", first {cached_prefix // bs * bs} from the prefix cache" if cached_prefix else ""
    served += f", static KV scales k={kv_scales[0]:g} v={kv_scales[1]:g}" if kv_scales else ""
    click.echo(f"{engine.model_config.name}: {len(ids)} tokens{served}, chunks of {chunk}, {engine.config.dtype} "
               f"weights, attention {engine.config.attention_backend} ({time.monotonic() - t0:.0f} s)")
    for line in table:
        click.echo(line)
    if hf_reference:
        for line in hf_reference_table(engine, ids, rows):
            click.echo(line)


@click.command("context-shift")
@click.option("--chunk", default=16, show_default=True, type=int, help="Teacher-forcing chunk (tokens).")
@click.option("--kv-dtypes", default="auto,int8,fp8_e4m3", show_default=True,
              help="Comma-separated --kv-cache-dtype values, one row each (the first is the drift's base).")
@click.option("--new-tokens", default=384, show_default=True, type=click.IntRange(1),
              help="Greedy tokens of the fluency check (past the context, with and without shifts).")
@engine_options
@one_line_errors
def bench_context_shift(chunk, kv_dtypes, new_tokens, max_model_len, keep, kv_cache_dtype, context_overflow,
                        **engine_kw):
    """Teacher-forced NLL of the ~1,000-token kv-quality text in a small shifting context
    (--max-model-len, default 256; --keep) vs the whole text in view, per KV dtype, with the
    requantization drift per shift and a greedy repetition check."""
    from llmd.daemon.bench.context_shift import context_shift_report
    from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT

    dtypes = tuple(d.strip() for d in kv_dtypes.split(",") if d.strip())
    max_model_len = max_model_len or 256
    if chunk < 1 or chunk >= max_model_len:
        raise LlmdError(f"--chunk must be in [1, {max_model_len}), got {chunk}")
    engine = build_engine(**engine_kw)
    ids = engine.input_processor.tokenize(QUALITY_TEXT)
    kw = {k: getattr(engine.config, k) for k in ("device", "dtype", "block_size", "kv_cache_memory",
                                                 "attention_backend", "threads", "kv_rotation")}
    kw["kv_rotation"] = engine_kw.get("kv_rotation")  # None: each dtype's default
    t0 = time.monotonic()
    for line in context_shift_report(engine.runner.model, engine.tokenizer, ids, max_model_len, keep, chunk, dtypes,
                                     new_tokens, **kw):
        click.echo(line)
    click.echo(f"({engine_kw['model']}, {engine.config.dtype} weights, {time.monotonic() - t0:.0f} s)")


@click.command("hybrid")
@click.option("--seq-tokens", default=2048, show_default=True, type=click.IntRange(2),
              help="Tokens per sequence (prompt + new).")
@click.option("--new-tokens", default=16, show_default=True, type=click.IntRange(1),
              help="Greedy tokens generated per sequence.")
@click.option("--num-requests", default=None, type=click.IntRange(1),
              help="Sequences (default: one more than the hybrid layout fits).")
@engine_options
@one_line_errors
def bench_hybrid(seq_tokens, new_tokens, num_requests, **engine_kw):
    """Long sequences decoding at once in one KV budget: hybrid KV cache groups vs every layer
    global (use a model with sliding-window layers: --model gemma3-270m)."""
    from llmd.daemon.bench.hybrid import run_hybrid_bench

    if new_tokens >= seq_tokens:  # the prompt is what is left of the sequence
        raise LlmdError(f"--new-tokens ({new_tokens}) must be < --seq-tokens ({seq_tokens})")
    engine = build_engine(**engine_kw)
    run_hybrid_bench(engine, seq_tokens, new_tokens, num_requests, echo=click.echo)


@click.command("beam")
@click.option("--prompt-tokens", default=64, show_default=True, type=click.IntRange(1),
              help="Prompt length (a fixed text).")
@click.option("--output-tokens", default=64, show_default=True, type=click.IntRange(1),
              help="New tokens per beam (ignore_eos).")
@click.option("--beam-width", default=4, show_default=True, type=click.IntRange(2),
              help="Beams (and independent requests).")
@engine_options
@one_line_errors
def bench_beam(prompt_tokens, output_tokens, beam_width, **engine_kw):
    """Peak KV blocks of one beam search (shared vs copied blocks) vs as many independent greedy
    requests, prefix caching off (one run)."""
    from llmd.daemon.bench.beam import run_beam_bench

    engine = build_engine(**{**engine_kw, "enable_prefix_caching": False})
    try:
        run_beam_bench(engine, prompt_tokens, output_tokens, beam_width, echo=click.echo)
    except ValueError as e:
        raise LlmdError(str(e)) from None


@click.command("kv-transfer")
@click.option("--prompt-tokens", default="256,1024,2048", show_default=True, callback=int_list,
              help="Comma-separated prompt lengths, one row each.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1),
              help="Measured rounds per length (medians).")
@click.option("--compare-gloo", is_flag=True, default=False,
              help="Also send the same byte counts with torch.distributed gloo send/recv between two processes.")
@engine_options
@one_line_errors
def bench_kv_transfer(prompt_tokens, repeats, compare_gloo, **engine_kw):
    """Prefill/decode disaggregation on loopback: KV pull bandwidth and the TTFT it adds per 1,000 tokens."""
    from llmd.daemon.bench.kv_transfer import run_kv_transfer_bench
    from llmd.daemon.core.config import EngineConfig
    from llmd.daemon.core.engine import Engine

    lengths = prompt_tokens

    def make(first):
        if first is None:
            return build_engine(**engine_kw)
        return Engine(first.runner.model, first.tokenizer, EngineConfig(**engine_kw))

    run_kv_transfer_bench(make, lengths, repeats, compare_gloo=compare_gloo, echo=click.echo)
