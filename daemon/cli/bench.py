"""``llmd bench ...``: the benchmark commands (what they run lives in :mod:`llmd.daemon.bench`)."""

from __future__ import annotations

import asyncio
import time

import click

from llmd.daemon.cli.common import build_engine, engine_options, one_line_errors, socket_option, socket_path_of
from llmd.daemon.core.errors import LlmdError


@click.group()
def bench():
    """Benchmarks that print side-by-side ratios measured in one run."""


def check_ranges(**bounds: int) -> None:
    """``--min-X`` <= ``--max-X`` for each pair given as ``min_X=..., max_X=...``, before any weights load.

    Raises:
        LlmdError: one naming both options and values.
    """
    for name, lo in bounds.items():
        if name.startswith("min_") and lo > bounds["max_" + name[4:]]:
            what = name[4:]
            raise LlmdError(f"--min-{what} ({lo}) must be <= --max-{what} ({bounds['max_' + what]})")


@bench.command("throughput")
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


@bench.command("single")
@click.option("--formats", default="none,auto,gguf,int8", show_default=True,
              help="Comma-separated --weight-quant formats, one row each (the first is the ratio's base; "
                   "nf4 / fp4 need bitsandbytes); they replace --weight-quant here.")
@click.option("--prompt", "prompt_len", default=512, show_default=True, type=click.IntRange(1),
              help="Prompt tokens (one step).")
@click.option("--decode", default=128, show_default=True, type=click.IntRange(1),
              help="Greedy tokens decoded at batch 1.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1),
              help="Runs per format; the best is shown.")
@engine_options
@one_line_errors
def bench_single(formats, prompt_len, decode, repeats, weight_quant, **engine_kw):
    """Single-stream prefill and batch-1 decode tok/s per --weight-quant format, side by side."""
    from llmd.daemon.bench.single import single_stream
    from llmd.daemon.core.config import EngineConfig

    fmts = [f.strip() for f in formats.split(",") if f.strip()]
    for f in fmts:  # every format checked (bitsandbytes present, device, dtype) before the first row runs
        try:
            resolved = EngineConfig(**{k: v for k, v in engine_kw.items() if k != "name"}, weight_quant=f).resolve()
        except LlmdError as e:
            raise LlmdError(f"--formats {f}: {str(e).replace('--weight-quant ', '')}") from None
        if prompt_len > resolved.max_num_batched_tokens:  # the prefill must be one step; known before any load
            raise LlmdError(f"--prompt {prompt_len} exceeds the token budget {resolved.max_num_batched_tokens} "
                            "(--max-num-batched-tokens)")
    try:
        single_stream(lambda f: build_engine(**engine_kw, weight_quant=f), fmts, prompt_len, decode, repeats,
                      echo=click.echo)
    except ValueError as e:
        raise LlmdError(str(e)) from None


@bench.command("kv-quality")
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


@bench.command("kernels")
@click.option("--block-n", default=32, show_default=True, type=int,
              help="Tokens per K/V tile in the decode kernel (the engine's DECODE_BLOCK_N).")
@one_line_errors
def bench_kernels(block_n):
    """Paged decode attention (bf16/int8/fp8 KV) vs torch SDPA and a d2d copy on the Llama-3-8B shape (CUDA)."""
    import torch

    if not torch.cuda.is_available():
        raise LlmdError("llmd bench kernels needs a CUDA device (see benchmarks/gpu_kernels.sh)")
    from llmd.kernels.bench import run_kernel_bench

    run_kernel_bench(click.echo, block_n=block_n)


@bench.command("prefix")
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

    engine = build_engine(**engine_kw)
    run_prefix_bench(engine, system_tokens, users, turns, max_tokens, echo=click.echo)

@bench.command("cascade")
@click.option("--system-tokens", default=1000, show_default=True, type=int, help="Shared system prompt (tokens).")
@click.option("--users", default=32, show_default=True, type=click.IntRange(1), help="Chats queued at once.")
@click.option("--max-tokens", default=32, show_default=True, type=int, help="New tokens per request (greedy).")
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1),
              help="Alternating runs per setting; best shown.")
@engine_options
@one_line_errors
def bench_cascade(system_tokens, users, max_tokens, repeats, **engine_kw):
    """Cascade attention on vs off on the shared-prefix workload shape (same model, one run)."""
    from llmd.daemon.bench.cascade import run_cascade_bench

    if min(system_tokens, users, max_tokens, repeats) < 1:
        raise LlmdError("--system-tokens, --users, --max-tokens and --repeats must be >= 1")
    engine = build_engine(**engine_kw)
    run_cascade_bench(engine, system_tokens, users, max_tokens, repeats, echo=click.echo)


@bench.command("beam")
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

@bench.command("hybrid")
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

@bench.command("chunked-prefill")
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


def choice_list(*choices: str):
    """A click callback: a comma-separated list of ``choices``; an unknown name is click's
    one-line usage error, before any weights load or the bandwidth probe runs."""
    def callback(ctx, param, value):
        names = name_list(ctx, param, value)
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise click.BadParameter(f"{', '.join(bad) or 'nothing'} is not one of {', '.join(choices)}")
        return names
    return callback

# bench step takes --dtype / --attention-backend as lists, sizes the KV pool itself and
# bypasses the scheduler, so those engine options are left off (the rest apply as usual)
not_for_step = {"dtype", "attention_backend", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "enable_prefix_caching", "prefix_cache_seed", "max_prefill_chunk", "max_num_waiting"}

def step_engine_options(fn):
    fn = engine_options(fn)
    fn.__click_params__ = [p for p in fn.__click_params__ if p.name not in not_for_step]
    return fn

@bench.command("step")
@click.option("--batch", default="1,8,32,64", show_default=True, callback=int_list,
              help="Batch sizes (decoding sequences), comma-separated.")
@click.option("--context", default="256,1024", show_default=True, callback=int_list,
              help="Tokens cached per sequence, comma-separated.")
@click.option("--dtype", "dtypes", default="float32,bfloat16", show_default=True,
              callback=choice_list("auto", "float32", "bfloat16", "float16", "float64"),
              help="Model dtypes, comma-separated (weights loaded once each).")
@click.option("--attention-backend", "backends", default="torch,cpu", show_default=True,
              callback=choice_list("cpu", "torch", "triton"),
              help="Attention backends, comma-separated (torch = the reference).")
@click.option("--reps", default=5, show_default=True, type=click.IntRange(min=1),
              help="Timed repetitions per component (median; after one warm-up).")
@click.option("--bandwidth-mib", default=512, show_default=True, type=click.IntRange(min=1),
              help="Tensor size of the read-bandwidth measurement (MiB).")
@step_engine_options
@one_line_errors
def bench_step(batch, context, dtypes, backends, reps, bandwidth_mib, **engine_kw):
    """Per-step time of decode steps split into preparation, linears, lm_head, attention and
    sampling, beside the linears-only and KV-read floors and the KV-gather read (the KV pool is
    sized to fit; every --kv-cache-dtype but int4, whose residual slots need the KV manager)."""
    from llmd.daemon.bench.step import run_step_bench

    if engine_kw.get("weight_quant") not in (None, "auto", "none"):
        raise LlmdError("llmd bench step times the dense weights (its linears replay reads them); "
                        "compare --weight-quant formats with `llmd bench single`")
    engine_kw["weight_quant"] = "none"

    run_step_bench(engine_kw, dtypes, backends, batch, context, reps, bandwidth_mib, echo=click.echo)


@bench.command("serve")
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


@bench.command("routing")
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


@bench.command("context-shift")
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


@bench.command("startup", context_settings={"ignore_unknown_options": True})
@click.option("--model", "-m", default="smollm2-135m", show_default=True, help="GGUF path or known model name.")
@click.option("--runs", default=3, show_default=True, type=click.IntRange(1), help="Starts per mode (medians shown).")
@click.option("--modes", default="cold,warm", show_default=True,
              help="Comma-separated, cold first: cold (empty cache), warm (its second start), uncached "
                   "(LLMD_WEIGHTS_CACHE=0: weights converted every start).")
@click.option("--timeout", default=600.0, show_default=True, type=float, help="Seconds one start may take.")
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED)
@one_line_errors
def bench_startup(model, runs, modes, timeout, serve_args):
    """Cold vs warm `llmd serve` to /health 200 (and `llmd kv-size`): wall and CPU seconds,
    medians over --runs, interleaved in one run; SERVE_ARGS after `--` go to every serve."""
    from llmd.daemon.bench.startup import run_startup_bench
    from llmd.models.registry import resolve_model

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not chosen or chosen[0] != "cold" or not set(chosen) <= {"cold", "warm", "uncached"} \
            or len(set(chosen)) != len(chosen):
        raise LlmdError(f"--modes must list cold first, then any of warm, uncached (once each), got {modes!r}")
    try:
        run_startup_bench(resolve_model(model), list(serve_args), runs, chosen, timeout, echo=click.echo)
    except RuntimeError as e:
        raise LlmdError(str(e)) from None


@bench.command("kv-transfer")
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
