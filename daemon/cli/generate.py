"""``llmd generate`` and ``llmd kv-size``: the model without a daemon."""

from __future__ import annotations

import sys
import time

import click

from llmd.daemon.cli.common import (
    build_engine,
    engine_options,
    model_option,
    one_line_errors,
    parse_bytes_option,
    prompt_text,
    served_id,
)
from llmd.daemon.core.errors import LlmdError, require_at_least_one


@click.command()
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template as a user message.")
@click.option("--max-tokens", default=None, type=int, help="New tokens at most (default: the remaining context).")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 = off.")
@click.option("--seed", default=None, type=int, help="Sampling seed (default: random).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--beam-width", default=1, show_default=True, type=click.IntRange(1),
              help="Beam search with this many beams (>= 2; greedy), printing every beam, best first; 1 = no beam "
                   "search (--length-penalty and --early-stopping then do nothing).")
@click.option("--length-penalty", default=1.0, show_default=True, type=float,
              help="Beam search: score = cumulative logprob / length ** this (vLLM's).")
@click.option("--early-stopping", default="false", show_default=True, type=click.Choice(["true", "false", "never"]),
              help="Beam search's stop rule (vLLM / HF early_stopping).")
@click.option("--truncate-prompt-tokens", default=None, type=int,
              help="Keep only the prompt's last N tokens (-1: the last --max-model-len - 1), vLLM's opt-in for "
                   "prompts longer than the context.")
@engine_options
@one_line_errors
def generate(prompt, chat, max_tokens, temperature, top_p, top_k, seed, stop, beam_width, length_penalty,
             early_stopping, truncate_prompt_tokens, **engine_kw):
    """Generate a completion for PROMPT (- reads it from stdin) with llmd's own engine, streaming
    text to stdout (with --beam-width K: the K beams, best first, once the search ends)."""
    from llmd.daemon.core.beam import check_beam_params
    from llmd.daemon.core.request import SamplingParams

    if max_tokens is not None and max_tokens < 1:
        raise LlmdError(f"--max-tokens must be >= 1, got {max_tokens}")
    prompt = prompt_text(prompt, "PROMPT")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop=list(stop), truncate_prompt_tokens=truncate_prompt_tokens)
    beam = beam_width > 1
    if beam:
        params.use_beam_search, params.length_penalty = True, length_penalty
        params.early_stopping = {"true": True, "false": False}.get(early_stopping, early_stopping)
    try:  # before the weights load
        params.validate()
        if beam:
            check_beam_params(params, beam_width)
    except ValueError as e:  # "--top-p must be in (0, 1], got 2.0"; beam refusals in the CLI's words
        text = str(e).replace("use_beam_search", "beam search (--beam-width)").replace(" (stop_token_ids are)", "")
        if text.startswith("beam search"):
            raise LlmdError(text.replace("temperature must", "--temperature must")) from None
        name, _, rest = text.partition(" ")
        raise LlmdError(f"--{name.replace('_', '-')} {rest}") from None
    if chat:  # fail before loading the weights (the GGUF header read is cached for the load)
        from llmd.models.gguf_loader import load_config
        from llmd.models.registry import resolve_model

        cfg = load_config(resolve_model(engine_kw["model"]))
        if not cfg.chat_template:
            raise LlmdError(f"model {engine_kw['model']} has no chat template (a base model); drop --chat")
    from llmd.daemon.core.config import EngineConfig
    from llmd.daemon.core.prompt_check import check_options_before_load, check_prompt_before_load

    request = [{"role": "user", "content": prompt}] if chat else prompt
    config = EngineConfig(**engine_kw).resolve()
    check_options_before_load(config)  # --keep in its own words, not the request's n_keep
    check_prompt_before_load(config, request, params)  # no weights loaded yet
    engine = build_engine(**engine_kw)
    from llmd.daemon.core.parallel import child_request_ids

    engine.add_parallel_request(request, params, child_request_ids("generate", beam_width))
    beams: dict[int, str] = {}
    t0 = time.monotonic()
    n, reason, error = 0, None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            n += len(out.new_token_ids)
            reason = out.finish_reason
            error = out.error or error
            if beam:
                beams[out.index] = f"[beam {out.index}, {out.finish_reason}] {out.new_text}"
                continue
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    if beams:
        sys.stdout.write("\n".join(beams[i] for i in sorted(beams)))
    sys.stdout.write("\n")
    dt = time.monotonic() - t0
    click.echo(f"llmd: {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), finish_reason={reason}", err=True)
    if error is not None:  # a failed generation is a failed command (exit 1), as llama-cli and ollama run
        raise LlmdError(f"the generation failed: {error}")


@click.command("kv-size")
@model_option
@click.option("--context", default=None, type=int,
              help="Tokens per sequence (default and upper bound: the model's context length; a larger value is "
                   "capped at it, as --max-model-len is).")
@click.option("--memory", default="512MiB", show_default=True, callback=parse_bytes_option, help="KV cache budget.")
@click.option("--block-size", default=16, show_default=True, type=int)
@click.option("--max-num-seqs", default=64, show_default=True, type=int,
              help="Sizes int4's open-block K residual (one 16-bit block per sequence and KV cache group).")
@click.option("--total-memory", default=None, callback=parse_bytes_option,
              help="Memory for weights + KV (e.g. 2GiB): per --weight-quant, what is left for a bfloat16 KV cache "
                   "and how many sequences of --context fit (GGUF models).")
@one_line_errors
def kv_size(model, context, memory, block_size, max_num_seqs, total_memory):
    """KV cache bytes per token and sequences that fit, per cache dtype (GGUF metadata only);
    with --total-memory, the weights per --weight-quant format and what fits beside them."""
    from llmd.daemon.core.kv_size import MIN_KV_BLOCKS, check_kv_memory, group_summary, kv_size_rows
    from llmd.daemon.kv import make_kv_cache_groups
    from llmd.daemon.protocol import fmt_bytes
    from llmd.models.header_cache import model_config
    from llmd.models.presets import is_random_model

    require_at_least_one(context=context, block_size=block_size, max_num_seqs=max_num_seqs)  # before the model resolves
    cfg = model_config(model)
    if context is None:
        context = cfg.max_position
    elif context > cfg.max_position:  # as the engine's model_context() caps --max-model-len
        click.echo(f"llmd: --context {context} is capped at the model's context length, {cfg.max_position} tokens",
                   err=True)
        context = cfg.max_position
    if total_memory is not None:
        if is_random_model(model):
            raise LlmdError("--total-memory needs a GGUF model (a random preset has no file to size)")
        _what_fits(model, cfg, context, total_memory, block_size)
        return
    windows = cfg.layer_windows
    layouts = ([(True, "")] if all(w is None for w in windows)
               else [(True, " (hybrid KV cache groups)"), (False, " (every layer global)")])
    check_kv_memory(cfg, memory, block_size, [hybrid for hybrid, _ in layouts], max_num_seqs)  # the engine's minimum
    # the model as llmd names it (the daemon's id for it), not the GGUF's own general.name
    click.echo(f"{served_id(model)}: {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims; "
               f"context {context} tokens; memory {memory:,} B ({fmt_bytes(memory)})")
    for hybrid, title in layouts:
        click.echo(group_summary(make_kv_cache_groups(windows, hybrid), block_size) + title)
        rows = kv_size_rows(cfg, context, memory, block_size, hybrid, max_num_seqs=max_num_seqs)
        # columns widen for a huge --memory, so its numbers never run together
        wb = max(10, 2 + max(len(str(r.num_blocks)) for r in rows))
        ws = max(12, 2 + max(len(f"{r.sequences:.2f}") for r in rows))
        click.echo(f"{'kv dtype':<12}{'B/token':>12}{'B/sequence':>16}{'blocks':>{wb}}{'sequences':>{ws}}"
                   f"{'x 16-bit':>10}")
        half = next(r.num_blocks for r in rows if r.name == "bf16/fp16")
        for r in rows:
            click.echo(f"{r.name:<12}{r.bytes_per_token:>12,.0f}{r.bytes_per_sequence:>16,.0f}{r.num_blocks:>{wb}}"
                       f"{r.sequences:>{ws}.2f}{r.num_blocks / half if half else 0:>9.2f}x")
        small = [r.name for r in rows if r.num_blocks < MIN_KV_BLOCKS]
        if small:
            click.echo(f"  {', '.join(small)}: fewer than {MIN_KV_BLOCKS} blocks, a budget the engine refuses for "
                       f"{'that dtype' if len(small) == 1 else 'those dtypes'}"
                       + (f" (int4 first sets aside its residual for --max-num-seqs {max_num_seqs})"
                          if "int4" in small else ""))


def _what_fits(model: str, cfg, context: int, total: int, block_size: int) -> None:
    """Weights per --weight-quant (bfloat16 model) and the bfloat16 KV cache left in ``total`` bytes."""
    from llmd.daemon.core.kv_size import kv_size_rows
    from llmd.models.header_cache import header_info
    from llmd.models.registry import layer_tensors as layer_tensors_of
    from llmd.models.registry import resolve_model
    from llmd.models.weight_bytes import (
        cpu_has_avx512_bf16,
        cpu_packs_bf16,
        cpu_runs_fused_decode,
        tied_head_copy_bytes,
        weight_bytes,
    )

    tensors = {t.name: t for t in header_info(resolve_model(model)).tensors}  # the cached header's tensor infos
    layer_tensors = layer_tensors_of(cfg.architecture)  # torch-free (not the model class)
    click.echo(f"{cfg.name}: bfloat16 model, context {context} tokens, total {total / 2**20:.0f} MiB for weights + KV")
    click.echo(f"{'--weight-quant':<16}{'weights MiB':>12}{'KV MiB':>10}{'sequences':>11}")
    bnb_cpu = cpu_has_avx512_bf16()  # nf4 in bitsandbytes' CPU layout (bfloat16 absmax) on this CPU
    fused = cfg.architecture == "llama" and cpu_runs_fused_decode()  # + the fused batch-1 kernel's copy
    head_copy = tied_head_copy_bytes(tensors) if cpu_packs_bf16() else 0
    for label, mode, keep in (("none", "none", False), ("auto", "gguf", True), ("gguf", "gguf", False),
                              ("int8", "int8", False), ("nf4", "nf4", False)):
        w = weight_bytes(tensors, layer_tensors, mode, 2, keep, bnb_cpu_layout=bnb_cpu, fused=fused and mode == "gguf")
        # the engine's packed copy of a tied head (startup line: "the tied LM head's as a copy"); nf4 keeps none
        w += head_copy if mode != "nf4" else 0
        left = total - w
        seqs = 0.0
        if left > 0:  # the bfloat16 KV row, by name
            seqs = next(r.sequences for r in kv_size_rows(cfg, context, left, block_size) if r.name == "bf16/fp16")
        click.echo(f"{label:<16}{w / 2**20:>12.0f}{max(left, 0) / 2**20:>10.0f}{seqs:>11.2f}")
