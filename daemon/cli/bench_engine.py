"""``llmd bench`` engine commands: one engine's speed on its own (single-stream tok/s per
weight format, a decode step by component, the decode kernels, start-up time)."""

from __future__ import annotations

import click

from llmd.daemon.cli.bench_options import choice_list, int_list
from llmd.daemon.cli.common import build_engine, engine_options, one_line_errors
from llmd.daemon.core.errors import LlmdError


@click.command("single")
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


# bench step takes --dtype / --attention-backend as lists, sizes the KV pool itself and
# bypasses the scheduler, so those engine options are left off (the rest apply as usual)
not_for_step = {"dtype", "attention_backend", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "enable_prefix_caching", "prefix_cache_seed", "max_prefill_chunk", "max_num_waiting"}

def step_engine_options(fn):
    fn = engine_options(fn)
    fn.__click_params__ = [p for p in fn.__click_params__ if p.name not in not_for_step]
    return fn


@click.command("step")
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


@click.command("kernels")
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


@click.command("startup", context_settings={"ignore_unknown_options": True})
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
