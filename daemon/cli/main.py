"""``llmd`` command line (click): generate, kv-size, bench.

User errors (:class:`LlmdError`) print one line ``llmd: error: ...`` and exit 1, never a traceback.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import click

from llmd.models.errors import LlmdError


def one_line_errors(fn):
    """Turn LlmdError (and Ctrl-C) into a one-line message and a non-zero exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LlmdError as e:
            click.echo(f"llmd: error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("llmd: interrupted", err=True)
            sys.exit(130)

    return wrapper


def parse_bytes_option(ctx, param, value):
    if value is None:
        return None
    from llmd.daemon.core.config import parse_bytes

    try:
        return parse_bytes(value)
    except LlmdError as e:
        raise click.BadParameter(str(e)) from None


def parse_kv_scales_option(ctx, param, value):
    if value is None:
        return None
    from llmd.daemon.core.config import parse_kv_scales

    try:
        return parse_kv_scales(value)
    except LlmdError as e:
        raise click.BadParameter(str(e)) from None


model_option = click.option("--model", "-m", default="smollm2-135m", show_default=True, help="GGUF path or known model name.")


def engine_options(fn):
    """Options shared by every command that builds an engine."""
    opts = [
        model_option,
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16", "float64"]), default="auto", show_default=True, help="Weights/activations dtype; auto = bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else float32; float64: CPU reference runs."),
        click.option("--threads", default=None, type=int, help="torch CPU threads (default: $OMP_NUM_THREADS if set, else the cores this process may use; two processes sharing the cores: split them, e.g. --threads 1 each on 2 cores)."),
        click.option("--device", default=None, help="cpu or cuda (default: cuda if available)."),
        click.option("--block-size", default=16, show_default=True, type=int, help="Tokens per KV block."),
        click.option("--kv-cache-memory", default=None, callback=parse_bytes_option, help="KV cache size, e.g. 512MiB (default: 512MiB on CPU, 80% of free memory on CUDA)."),
        click.option("--max-num-seqs", default=32, show_default=True, type=int, help="Sequences running at once at most."),
        click.option("--max-num-batched-tokens", default=None, type=int, help="Token budget per step (default: 256 on CPU, 4096 on CUDA)."),
        click.option("--max-model-len", default=None, type=int, help="Context cap in tokens (default: the model's)."),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8_e4m3", "fp8_e5m2", "int8"]), default="auto", show_default=True, help="KV cache storage: auto = model dtype; 8-bit formats keep float32 scales per (token, KV head)."),
        click.option("--kv-scales", default=None, callback=parse_kv_scales_option, help="Static per-tensor KV scales k,v (vLLM convention: stored = x / scale); default: dynamic."),
        click.option("--attention-backend", type=click.Choice(["cpu", "torch", "triton"]), default=None, help="Attention ops: cpu (fast batched CPU path), torch (the pure-torch reference), triton (default: triton on CUDA, cpu on CPU; torch with --dtype float64)."),
        click.option("--disable-hybrid-kv-cache-manager", is_flag=True, default=False, help="Keep every block of sliding-window layers (one full-attention KV cache group), as vLLM's flag."),
        click.option("--enable-prefix-caching/--no-prefix-caching", default=True, show_default=True, help="Reuse the KV of cached full blocks across requests (block-chain hashes)."),
        click.option("--prefix-cache-seed", default=None, type=int, help="Seed of the block-hash chain root (default: random per daemon; for tests)."),
        click.option("--max-prefill-chunk", default=None, type=int, help="Prefill tokens of one request per step (default: the token budget)."),
        click.option("--max-num-waiting", default=1024, show_default=True, type=int, help="Waiting requests at most; beyond it HTTP 429 with Retry-After."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def build_engine(**kw):
    from llmd.daemon.core.config import EngineConfig
    from llmd.daemon.core.engine import Engine

    config = EngineConfig(**kw).resolve()  # bad settings fail before the weights load
    click.echo(f"llmd: loading {kw['model']} ({config.dtype}, {config.threads} thread{'' if config.threads == 1 else 's'}) ...", err=True)
    t0 = time.monotonic()
    engine = Engine.from_config(config)
    click.echo(f"llmd: loaded {engine.model_config.name} in {time.monotonic() - t0:.1f} s; {engine.runtime_summary()}; "
               f"{engine.capacity_summary()}", err=True)
    return engine


class OneLineUsageErrors(click.Group):
    """click's usage errors (bad option values, unknown options) as one line
    ``llmd: error: ...`` with click's exit code 2, instead of usage + hint + error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as e:
            ctx = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            click.echo(f"llmd: error: {e.format_message()}{ctx}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("llmd: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=OneLineUsageErrors, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """llmd: a local LLM inference daemon (continuous batching over a paged KV cache)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@main.command()
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template as a user message.")
@click.option("--max-tokens", default=None, type=int, help="New tokens at most (default: the remaining context).")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 = off.")
@click.option("--seed", default=None, type=int, help="Sampling seed (default: random).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@engine_options
@one_line_errors
def generate(prompt, chat, max_tokens, temperature, top_p, top_k, seed, stop, **engine_kw):
    """Generate a completion for PROMPT with llmd's own engine, streaming text to stdout."""
    from llmd.daemon.core.request import SamplingParams

    if max_tokens is not None and max_tokens < 1:
        raise LlmdError(f"--max-tokens must be >= 1, got {max_tokens}")
    if not prompt:
        raise LlmdError("PROMPT is empty")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=list(stop))
    try:  # before the weights load
        params.validate()
    except ValueError as e:
        raise LlmdError("--" + str(e).replace("_", "-")) from None  # "--top-p must be in (0, 1], got 2.0"
    if chat:  # fail before loading the weights (the GGUF header read is cached for the load)
        from llmd.models.gguf_loader import load_config
        from llmd.models.registry import resolve_model

        cfg = load_config(resolve_model(engine_kw["model"]))
        if not cfg.chat_template:
            raise LlmdError(f"model {cfg.name} has no chat template (a base model); drop --chat")
    engine = build_engine(**engine_kw)
    ids = engine.tokenizer.apply_chat([{"role": "user", "content": prompt}]) if chat else engine.tokenizer.encode(prompt)
    engine.add_request(ids, params)
    t0 = time.monotonic()
    n, reason = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            n += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            reason = out.finish_reason
    sys.stdout.write("\n")
    dt = time.monotonic() - t0
    click.echo(f"llmd: {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), finish_reason={reason}", err=True)


@main.command("kv-size")
@model_option
@click.option("--context", default=None, type=int, help="Tokens per sequence (default: the model's context length).")
@click.option("--memory", default="512MiB", show_default=True, callback=parse_bytes_option, help="KV cache budget.")
@click.option("--block-size", default=16, show_default=True, type=int)
@one_line_errors
def kv_size(model, context, memory, block_size):
    """KV cache bytes per token and sequences that fit, per cache dtype (GGUF metadata only)."""
    from llmd.daemon.kv import make_kv_cache_groups
    from llmd.daemon.core.kv_size import group_summary, kv_size_rows
    from llmd.models.gguf_loader import load_config
    from llmd.models.registry import resolve_model

    cfg = load_config(resolve_model(model))
    context = context or cfg.max_position
    click.echo(f"{cfg.name}: {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims; context {context} tokens; memory {memory} B ({memory / 2**20:.0f} MiB)")
    windows = cfg.sliding_window or (None,) * cfg.num_layers
    layouts = [(True, "")] if all(w is None for w in windows) else [(True, " (hybrid KV cache groups)"), (False, " (every layer global)")]
    for hybrid, title in layouts:
        click.echo(group_summary(make_kv_cache_groups(windows, hybrid), block_size) + title)
        click.echo(f"{'kv dtype':<12}{'B/token':>12}{'B/sequence':>16}{'blocks':>10}{'sequences':>12}")
        for r in kv_size_rows(cfg, context, memory, block_size, hybrid):
            click.echo(f"{r.name:<12}{r.bytes_per_token:>12,.0f}{r.bytes_per_sequence:>16,.0f}{r.num_blocks:>10}{r.sequences:>12.2f}")


@main.group()
def bench():
    """Benchmarks that print side-by-side ratios measured in one run."""


@bench.command("throughput")
@click.option("--num-requests", default=32, show_default=True, type=int)
@click.option("--min-prompt", default=16, show_default=True, type=int)
@click.option("--max-prompt", default=256, show_default=True, type=int)
@click.option("--min-output", default=8, show_default=True, type=int)
@click.option("--max-output", default=128, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@engine_options
@one_line_errors
def bench_throughput(num_requests, min_prompt, max_prompt, min_output, max_output, seed, **engine_kw):
    """Continuous vs static batching on the same seeded mixed-length requests."""
    from llmd.daemon.bench.throughput import run_throughput_bench

    engine = build_engine(**engine_kw)
    run_throughput_bench(engine, num_requests, (min_prompt, max_prompt), (min_output, max_output), seed, echo=click.echo)


@bench.command("kv-quality")
@click.option("--chunk", default=64, show_default=True, type=int, help="Teacher-forcing chunk (tokens); store-then-read.")
@click.option("--hf-reference", is_flag=True, help="Also run HF transformers with fake-quantized K/V (loads the HF model, in --dtype).")
@click.option("--cached-prefix", default=0, show_default=True, type=int,
              help="Serve this many leading tokens from the prefix cache (a first request computes them); 0 = off.")
@engine_options
@one_line_errors
def bench_kv_quality(chunk, hf_reference, cached_prefix, kv_cache_dtype, **engine_kw):
    """Teacher-forced ΔNLL and top-1 agreement per KV dtype on a fixed ~1,000-token text (cases Q1/Q4)."""
    from llmd.daemon.bench.kv_quality import KV_DTYPES, format_table, kv_quality
    from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT

    kv_scales = engine_kw.pop("kv_scales", None)  # for the quantized rows (the first engine is auto)
    if kv_scales is not None:  # fail before the weights load
        from llmd.daemon.core.config import EngineConfig

        EngineConfig(device=engine_kw.get("device") or "cpu", kv_cache_dtype="int8", kv_scales=kv_scales).resolve()
    if cached_prefix < 0:
        raise LlmdError(f"--cached-prefix must be >= 0 tokens, got {cached_prefix}")
    engine = build_engine(**engine_kw)
    ids = engine.tokenizer.encode(QUALITY_TEXT)
    kw = {k: getattr(engine.config, k) for k in ("device", "dtype", "block_size", "kv_cache_memory", "attention_backend", "threads")}
    t0 = time.monotonic()
    if not 0 <= cached_prefix < len(ids):
        raise LlmdError(f"--cached-prefix must be in [0, {len(ids)}) tokens, got {cached_prefix}")
    if cached_prefix and not engine.config.enable_prefix_caching:
        raise LlmdError("--cached-prefix needs prefix caching (drop --no-prefix-caching)")
    rows = kv_quality(engine.runner.model, engine.tokenizer, ids, KV_DTYPES, chunk, cached_prefix, kv_scales, **kw)
    served = f", first {cached_prefix // engine.config.block_size * engine.config.block_size} from the prefix cache" if cached_prefix else ""
    served += f", static KV scales k={kv_scales[0]:g} v={kv_scales[1]:g}" if kv_scales else ""
    click.echo(f"{engine.model_config.name}: {len(ids)} tokens{served}, chunks of {chunk}, {engine.config.dtype} weights, "
               f"attention {engine.config.attention_backend} ({time.monotonic() - t0:.0f} s)")
    for line in format_table(rows):
        click.echo(line)
    if hf_reference:
        _hf_fake_quant_table(engine, ids, rows)


def _hf_fake_quant_table(engine, ids, rows):
    import torch
    from transformers import AutoModelForCausalLM

    from llmd.daemon.bench.kv_quality import hf_fake_quant_nll, nll_and_argmax
    from llmd.models.registry import resolve_model

    path = resolve_model(engine.config.model)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    hf = hf.to(engine.config.torch_dtype)  # float32 dequantized GGUF weights, cast as llmd's are
    with torch.inference_mode():
        base = nll_and_argmax(hf(torch.tensor([ids])).logits[0], ids)[0]
    click.echo(f"HF transformers fake-quant reference: NLL {base:.4f} ({engine.config.dtype})")
    for r in rows[1:]:
        ref = 100 * (hf_fake_quant_nll(hf, ids, r.kv_cache_dtype) - base) / base
        click.echo(f"{r.kv_cache_dtype:<10} ΔNLL llmd {r.delta_nll_pct:.3f}%  HF fake-quant {ref:.3f}%  |diff| {abs(r.delta_nll_pct - ref):.3f} pp")


@bench.command("kernels")
@click.option("--block-n", default=64, show_default=True, type=int, help="Tokens per K/V tile in the decode kernel.")
@one_line_errors
def bench_kernels(block_n):
    """Paged decode attention (bf16/int8/fp8 KV) vs torch SDPA and a d2d copy on the Llama-3-8B shape (CUDA)."""
    import torch

    if not torch.cuda.is_available():
        raise LlmdError("llmd bench kernels needs a CUDA device (see benchmarks/gpu_kernels.sh)")
    from llmd.kernels.bench import run_kernel_bench

    run_kernel_bench(click.echo, block_n=block_n)


# serve, chat, ps, status, stop (daemon/cli_daemon.py); bench prefix (daemon/cli_bench.py)
from llmd.daemon.cli.bench import register as _register_bench_commands  # noqa: E402
from llmd.daemon.cli.daemon import register as _register_daemon_commands  # noqa: E402
from llmd.daemon.cli.top import register as _register_top_command  # noqa: E402

_register_daemon_commands(main, engine_options, one_line_errors, build_engine)
_register_bench_commands(bench, engine_options, one_line_errors, build_engine)
_register_top_command(main, one_line_errors)  # llmd top (daemon/cli_top.py, tui/)

if __name__ == "__main__":
    main()
