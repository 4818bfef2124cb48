"""Daemon commands of the ``llmd`` CLI: ``serve``, ``chat``, ``ps``, ``status``, ``stop``.

:func:`register` adds them to the click group; ``cli.py`` passes in its shared pieces
(``engine_options``, ``one_line_errors``, ``build_engine``) so this module never imports
``cli.py`` (which may be running as ``__main__``).
"""

from __future__ import annotations

import asyncio
import logging
import os

import click
from click.core import ParameterSource

from llmd.models.errors import LlmdError

socket_option = click.option("--socket", "socket_path", default=None,
                             help="Daemon socket (default: $LLMD_SOCKET, else $XDG_RUNTIME_DIR/llmd/llmd.sock, else ~/.cache/llmd/llmd.sock).")


def _path(socket_path):
    from llmd.daemon.protocol import default_socket_path

    return socket_path or default_socket_path()


def _client(socket_path, timeout=10.0):
    from llmd.daemon.client.client import Client

    return Client(_path(socket_path), timeout=timeout)


def _served_id(model: str) -> str:
    base = os.path.basename(model)
    return base[:-5] if base.endswith(".gguf") else base


def register(main, engine_options, one_line_errors, build_engine) -> None:
    """Add the daemon commands to ``main``."""

    @main.command()
    @socket_option
    @click.option("--host", default=None, help="Also listen on TCP at this host (needs --port; default 127.0.0.1).")
    @click.option("--port", default=None, type=int, help="Also listen on TCP at this port (off by default).")
    @click.option("--served-model-name", default=None, help="Model id in the API (default: the --model name).")
    @click.option("--drain-timeout", default=30.0, show_default=True, type=float, help="Seconds in-flight requests get on shutdown before they are aborted.")
    @click.option("--metrics-compat", default=None, type=click.Choice(["vllm"]), help="Also export GET /metrics under vLLM's names (vllm: prefix) for existing dashboards.")
    @engine_options
    @one_line_errors
    def serve(socket_path, host, port, served_model_name, drain_timeout, metrics_compat, **engine_kw):
        """Run the daemon: OpenAI-style HTTP API on a Unix socket (SIGTERM or `llmd stop` ends it)."""
        from llmd.daemon.serving.lifecycle import claim_socket, run_server

        if host is not None and port is None:
            raise LlmdError("--host needs --port")
        path = _path(socket_path)
        lock_fd = claim_socket(path)  # fail fast, before loading the model
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        engine = build_engine(**engine_kw)
        model_id = served_model_name or _served_id(engine_kw["model"])
        ids = tuple(dict.fromkeys([model_id, engine_kw["model"], engine.model_config.name]))
        asyncio.run(run_server(engine, path, model_id, ids, host=host, port=port, drain_timeout=drain_timeout,
                               lock_fd=lock_fd, metrics_compat=metrics_compat, echo=lambda m: click.echo(m, err=True)))

    @main.command()
    @socket_option
    @click.option("-p", "--prompt", default=None, help="Answer this one question and exit.")
    @click.option("--system", default=None, help="System prompt.")
    @click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy (the default: small models answer best greedy); e.g. 0.7 for varied replies.")
    @click.option("--top-p", default=1.0, show_default=True, type=float)
    @click.option("--max-tokens", default=None, type=int, help="New tokens per reply at most (default: the remaining context).")
    @click.option("--seed", default=None, type=int)
    @click.option("--no-daemon", is_flag=True, help="Run the engine in this process instead of talking to a daemon.")
    @click.option("--daemon-log", default=None, help="Log file of an auto-started daemon (default: ~/.cache/llmd/daemon.log).")
    @engine_options
    @one_line_errors
    def chat(socket_path, prompt, system, temperature, top_p, max_tokens, seed, no_daemon, daemon_log, **engine_kw):
        """Chat with the model; starts a background daemon if none runs (it keeps running: `llmd stop`)."""
        from llmd.daemon.client import chat as chat_mod

        params = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed}
        if no_daemon:
            backend = chat_mod.LocalBackend(build_engine(**engine_kw))
        else:
            already = _client(socket_path).health() is not None
            client = chat_mod.ensure_daemon(_path(socket_path), chat_mod.engine_args(engine_kw), daemon_log)
            if already:
                ctx = click.get_current_context()
                given = [k for k in engine_kw if ctx.get_parameter_source(k) in (ParameterSource.COMMANDLINE,
                                                                                   ParameterSource.ENVIRONMENT)]
                chat_mod.check_running_daemon(client, engine_kw["model"] if "model" in given else None,
                                              ["--" + k.replace("_", "-") for k in given if k != "model"])
            backend = chat_mod.DaemonBackend(client)
        chat_mod.run_chat(backend, params, system=system, prompt=prompt)

    @main.command()
    @socket_option
    @one_line_errors
    def ps(socket_path):
        """Running and waiting requests of the daemon."""
        from llmd.daemon.protocol import check_stats_schema

        st = _client(socket_path).stats()
        check_stats_schema(st)
        click.echo(f"{'ID':<36}{'STATE':<9}{'PROMPT':>7}{'CACHED':>7}{'GEN':>6}{'BLOCKS':>7}{'TTFT s':>8}{'AGE s':>7}")
        for r in st["requests"]:
            ttft = "-" if r["ttft_s"] is None else f"{r['ttft_s']:.2f}"
            click.echo(f"{r['id']:<36}{r['state']:<9}{r['prompt_tokens']:>7}{r['cached_tokens']:>7}"
                       f"{r['generated_tokens']:>6}{r['blocks']:>7}{ttft:>8}{r['age_s']:>7.1f}")

    @main.command()
    @socket_option
    @one_line_errors
    def status(socket_path):
        """Model, KV dtype, blocks used/total, prefix-cache hit rate, uptime."""
        from llmd.daemon.protocol import check_stats_schema

        c = _client(socket_path)
        st = c.stats()
        check_stats_schema(st)
        kv, pc, sc = st["kv_cache"], st["prefix_cache"], st["scheduler"]
        hit = f"{pc['hits'] / pc['queries']:.1%}" if pc["queries"] else "n/a"
        click.echo(f"daemon:      {c.socket_path} (pid {c.health()['pid']}), up {st['uptime_s']:.0f} s")
        click.echo(f"model:       {st['model']}, KV cache dtype {st['kv_cache_dtype']}")
        click.echo(f"KV blocks:   {kv['used']}/{kv['total']} used ({kv['usage']:.1%}), block size {kv['block_size']}")
        click.echo(f"prefix hits: {hit} ({pc['hits']}/{pc['queries']} tokens)")
        click.echo(f"requests:    {sc['running']} running, {sc['waiting']} waiting; "
                   f"{st['throughput']['generation_tokens_per_s']:.1f} gen tok/s")

    bench = main.commands.get("bench")
    if bench is not None:
        @bench.command("serve")
        @socket_option
        @click.option("--num-requests", default=64, show_default=True, type=int)
        @click.option("--rate", default=4.0, show_default=True, type=float, help="Poisson arrival rate, requests/s.")
        @click.option("--min-prompt", default=16, show_default=True, type=int)
        @click.option("--max-prompt", default=256, show_default=True, type=int)
        @click.option("--min-output", default=8, show_default=True, type=int)
        @click.option("--max-output", default=128, show_default=True, type=int)
        @click.option("--seed", default=0, show_default=True, type=int)
        @one_line_errors
        def bench_serve(socket_path, num_requests, rate, min_prompt, max_prompt, min_output, max_output, seed):
            """Open-loop load on a running daemon: throughput, TTFT, TPOT, ITL p50/p99."""
            from llmd.daemon.bench.serve import run_serve_bench

            if rate <= 0 or num_requests < 1:
                raise LlmdError("--rate must be > 0 and --num-requests >= 1")
            asyncio.run(run_serve_bench(_path(socket_path), num_requests, rate, (min_prompt, max_prompt),
                                        (min_output, max_output), seed, echo=click.echo))

    @main.command()
    @socket_option
    @click.option("--timeout", default=60.0, show_default=True, type=float, help="Seconds to wait for the daemon to exit.")
    @one_line_errors
    def stop(socket_path, timeout):
        """Stop the daemon gracefully (in-flight requests finish or are aborted after its drain timeout);
        returns once the process has exited, so `llmd serve` can start again at once."""
        c = _client(socket_path)
        health = c.health()
        if health is None:
            click.echo(f"llmd: no daemon running on {c.socket_path}")
            return
        from llmd.daemon.client.chat import wait_for_daemon_exit

        c.shutdown()
        click.echo(f"llmd: stopping the daemon on {c.socket_path} (pid {health['pid']}); in-flight requests get "
                   f"its drain timeout", err=True)
        if not wait_for_daemon_exit(c.socket_path, timeout, health.get("pid")):
            raise LlmdError(f"the daemon on {c.socket_path} did not exit within {timeout:.0f} s")
        click.echo("llmd: daemon stopped")
