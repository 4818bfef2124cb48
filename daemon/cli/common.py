"""What every ``llmd`` command shares: one-line errors, the engine and socket options, engine building.

User errors (:class:`LlmdError`) print one line ``llmd: error: ...`` and exit 1, never a
traceback (:func:`one_line_errors`); click's own usage errors are made one line by the group
in :mod:`llmd.daemon.cli.main`. Option values are checked before any weights load.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import click

from llmd.daemon.cli.startup_interrupt import exit_interrupted
from llmd.daemon.core.errors import LlmdError


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
            exit_interrupted()

    return wrapper


def prompt_text(value: str | None, name: str) -> str | None:
    """A prompt option's text: ``-`` reads all of stdin (as ``cat``, llama.cpp's ``-f /dev/stdin``
    or a pipe into ``ollama run``), its trailing newlines stripped as the shell's ``$(...)`` does;
    anything else is the text itself.

    Raises:
        LlmdError: ``name`` is empty, ``-`` read only newlines, or the text is not UTF-8 (the
            tokenizer raised a TypeError traceback on the undecodable bytes).
    """
    if value == "-":
        stdin = getattr(sys.stdin, "buffer", None)
        try:
            value = stdin.read().decode("utf-8") if stdin is not None else sys.stdin.read()
        except UnicodeDecodeError as e:
            raise LlmdError(f"{name} is - but stdin is not UTF-8 text ({e.reason} at byte {e.start})") from None
        value = value.rstrip("\r\n")
        if not value:
            raise LlmdError(f"{name} is - but stdin gave no text")
    elif value is not None and not value:
        raise LlmdError(f"{name} is empty")
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # argv's undecodable bytes, as surrogates
            raise LlmdError(f"{name} is not UTF-8 text (undecodable byte at character {e.start})") from None
    return value


def parse_bytes_option(ctx, param, value):
    if value is None:
        return None
    from llmd.daemon.core.option_values import parse_bytes

    try:
        return parse_bytes(value)
    except LlmdError as e:
        raise click.BadParameter(str(e)) from None


def parse_kv_scales_option(ctx, param, value):
    if value is None:
        return None
    from llmd.daemon.core.option_values import parse_kv_scales

    try:
        return parse_kv_scales(value)
    except LlmdError as e:
        raise click.BadParameter(str(e)) from None


model_option = click.option("--model", "-m", default="smollm2-135m", show_default=True,
                            help="GGUF path, known model name, or random:<preset> (random weights, e.g. "
                                 "random:qwen3-0.6b).")

socket_option = click.option("--socket", "socket_path", default=None,
                             help="Daemon socket (default: $LLMD_SOCKET, else $XDG_RUNTIME_DIR/llmd/llmd.sock, "
                                  "else ~/.cache/llmd/llmd.sock).")


def engine_options(fn):
    """Options shared by every command that builds an engine (the fields of ``EngineConfig``)."""
    opts = [
        model_option,
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16", "float64"]),
                     default="auto", show_default=True,
                     help="Weights/activations dtype; auto = bfloat16 on CUDA and on CPUs with native bf16 "
                          "(AVX512-BF16/AMX), else float32; float64: CPU reference runs."),
        click.option("--weight-quant", type=click.Choice(["auto", "none", "gguf", "int8", "nf4", "fp4"]),
                     default="auto", show_default=True,
                     help="Linear weights: gguf (CPU) = the file's 4-bit blocks as int4 packs (Q8_0 as int8), "
                          "dense weights dropped; int8 = int8 with a scale per 32 input columns (CPU; CUDA: "
                          "bitsandbytes LLM.int8()); nf4 / fp4 = bitsandbytes 4-bit blocks of 64 (CPU and "
                          "CUDA); auto = on a "
                          "bfloat16 CPU model the gguf packs for steps of <= 4 tokens plus the dense weights for "
                          "larger steps, else none."),
        click.option("--threads", default=None, type=int,
                     help="torch CPU threads (default: $OMP_NUM_THREADS if set, else the cores this process may use; "
                          "two processes sharing the cores: split them, e.g. --threads 1 each on 2 cores)."),
        click.option("--device", default=None, help="cpu or cuda (default: cuda if available)."),
        click.option("--block-size", default=16, show_default=True, type=int,
                     help="Tokens per KV block. Prefix-cache hits are whole blocks; the CPU's C decode "
                          "kernels take blocks of up to 128 tokens."),
        click.option("--kv-cache-memory", default=None, callback=parse_bytes_option,
                     help="KV cache size, e.g. 512MiB (default: 512MiB on CPU; on CUDA what "
                          "--gpu-memory-utilization leaves)."),
        click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=float,
                     help="CUDA: fraction of the device's total memory for weights + activations + KV cache "
                          "(vLLM's meaning); the KV cache gets what is left."),
        click.option("--enforce-eager", is_flag=True, default=False,
                     help="CUDA: no CUDA graphs for decode steps (vLLM's flag); every step runs eagerly."),
        click.option("--disable-cascade-attn", is_flag=True, default=False,
                     help="CPU: decodes sharing a prefix attend to it each on their own, not once per group "
                          "(vLLM's flag; for comparisons)."),
        click.option("--disable-native-kernels", is_flag=True, default=False,
                     help="CPU: decodes attend through torch ops instead of llmd's C kernel (built with the "
                          "system C compiler on first use); for comparisons."),
        click.option("--max-num-seqs", default=None, type=int,
                     help="Sequences running at once at most (default: 256 on CUDA, 64 on CPU)."),
        click.option("--max-num-batched-tokens", default=None, type=int,
                     help="Token budget per step (default: 512 on CPU, 4096 on CUDA)."),
        click.option("--max-model-len", default=None, type=int, help="Context cap in tokens (default: the model's)."),
        click.option("--kv-cache-dtype",
                     type=click.Choice(["auto", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]),
                     default="auto", show_default=True,
                     help="KV cache storage: auto = model dtype; float16 / bfloat16 = K/V rounded to "
                          "that 16-bit float, no scales (half a float32 model's bytes; cpu/torch "
                          "backends); 8-bit formats keep float32 scales per "
                          "(token, KV head); int4 packs two codes per byte: K per channel over each "
                          "16-token block (KIVI; the open block's K in 16 bits), V with a float16 scale "
                          "per 16 channels."),
        click.option("--kv-rotation", type=click.Choice(["none", "hadamard"]), default=None,
                     help="Rotate K (after RoPE) per head by a Walsh-Hadamard matrix before quantizing "
                          "(the query is rotated to match; default: hadamard for int8)."),
        click.option("--kv-scale-group-size", default=0, show_default=True, type=int,
                     help="int8/fp8: one dynamic scale per this many channels of a (token, KV head) instead of "
                          "one per (token, KV head); 32 or 64 (cpu/torch backends)."),
        click.option("--kv-scales", default=None, callback=parse_kv_scales_option,
                     help="Static per-tensor KV scales k,v (vLLM convention: stored = x / scale); default: dynamic."),
        click.option("--attention-backend", type=click.Choice(["cpu", "torch", "triton"]), default=None,
                     help="Attention ops: cpu (fast batched CPU path), torch (the pure-torch reference), triton "
                          "(default: triton on CUDA, cpu on CPU; torch with --dtype float64)."),
        click.option("--disable-hybrid-kv-cache-manager", is_flag=True, default=False,
                     help="Keep every block of sliding-window layers (one full-attention KV cache group), "
                          "as vLLM's flag."),
        click.option("--enable-prefix-caching/--no-prefix-caching", default=True, show_default=True,
                     help="Reuse the KV of cached full blocks across requests (block-chain hashes)."),
        click.option("--prefix-cache-seed", default=None, type=int,
                     help="Seed of the block-hash chain root (default: random per daemon; for tests)."),
        click.option("--max-prefill-chunk", default=None, type=int,
                     help="Prefill tokens of one request per step (default: the token budget)."),
        click.option("--max-num-waiting", default=1024, show_default=True, type=int,
                     help="Waiting requests at most; beyond it HTTP 429 with Retry-After."),
        click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), default="fcfs",
                     show_default=True,
                     help="fcfs: arrival order (a request's non-zero priority is a 400); priority: lower `priority` "
                          "runs first and the largest is preempted first (vLLM's flag)."),
        click.option("--context-overflow", type=click.Choice(["stop", "shift"]), default="stop", show_default=True,
                     help="A sequence that fills --max-model-len: stop (finish_reason length; prompt + max_tokens "
                          "beyond the context is a 400) or shift (llama.cpp's --context-shift: keep --keep tokens, "
                          "drop the oldest half of the rest, re-rotate the cached keys, go on)."),
        click.option("--keep", default=0, show_default=True, type=int,
                     help="Tokens a context shift keeps at the head, e.g. the system prompt (rounded up to whole "
                          "blocks, at least the first block: the attention sink; -1 = the whole prompt); "
                          "llama.cpp's --keep."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def build_engine(name: str | None = None, echo=None, **kw):
    """An :class:`Engine` from engine options, with the loading and loaded lines on stderr
    (settings are validated before the weights load). ``name``: the model's name in those
    lines (the daemon's served name; default the ``--model`` value), never the GGUF's own
    ``general.name``. ``echo``: what writes those lines (default ``click.echo`` to stderr;
    ``llmd serve`` passes one that survives a gone reader)."""
    from llmd.daemon.core.config import EngineConfig
    from llmd.daemon.core.engine import Engine
    from llmd.daemon.core.prompt_check import check_options_before_load

    config = EngineConfig(**kw).resolve()  # bad settings fail before the weights load
    check_options_before_load(config)  # and those whose limits are in the model's header (--keep)
    threads = f"{config.threads} thread{'' if config.threads == 1 else 's'}"
    name = name or kw["model"]
    echo = echo or functools.partial(click.echo, err=True)
    echo(f"llmd: loading {name} ({config.dtype}, {threads}) ...")
    t0 = time.monotonic()
    engine = Engine.from_config(config)
    echo(f"llmd: loaded {name} in {time.monotonic() - t0:.1f} s; {engine.runtime_summary()}; "
         f"{engine.capacity_summary()}")
    return engine


def served_id(model: str) -> str:
    """The API's model id for ``--model``: a GGUF path's file name without ``.gguf``, else the name
    (also ``llmd kv-size``'s title for the model)."""
    base = os.path.basename(model)
    return base[:-5] if base.endswith(".gguf") else base


def socket_path_of(socket_path: str | None) -> str:
    """``--socket``, else the default socket path (``protocol.default_socket_path``)."""
    from llmd.daemon.protocol import default_socket_path

    return socket_path or default_socket_path()


def client_for(socket_path: str | None, timeout: float = 10.0):
    """A :class:`~llmd.daemon.client.Client` of the daemon on ``--socket`` (or the default)."""
    from llmd.daemon.client.client import Client

    return Client(socket_path_of(socket_path), timeout=timeout)
