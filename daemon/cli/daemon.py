"""The daemon's commands: ``llmd serve``, ``llmd ps``, ``llmd status``, ``llmd stop``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading

import click

from llmd.daemon.cli.common import (
    build_engine,
    client_for,
    engine_options,
    one_line_errors,
    served_id,
    socket_option,
    socket_path_of,
)
from llmd.daemon.cli.daemon_output import DaemonLogHandler, echo_err
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.serving.engine_health import DEFAULT_STALL_TIMEOUT_S


def serve_title(argv: list[str]) -> str:
    """The daemon's process title: ``llmd serve`` and the arguments after ``serve`` in ``argv``
    (the value of ``--api-key`` masked), whether it was started as the ``llmd`` script or as
    ``python -c ...`` by ``llmd chat`` (``spawn.SERVE_COMMAND``)."""
    args = argv[argv.index("serve") + 1:] if "serve" in argv else []
    shown = ["***" if i and args[i - 1] == "--api-key" else a.split("=")[0] + "=***"
             if a.startswith("--api-key=") else a for i, a in enumerate(args)]
    return " ".join(["llmd", "serve", *shown])


def given_options(ctx: click.Context, *names: str) -> set[str]:
    """The flags (``--kv-pin-timeout``) of the parameters ``names`` that the user set, on the
    command line or through the environment, rather than left at their defaults."""
    from click.core import ParameterSource

    by_name = {p.name: p for p in ctx.command.params}
    return {by_name[n].opts[0] for n in names
            if ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}


def _exit_on_sigterm(signum, frame):
    """SIGTERM before the server runs: exit as SIGTERM's default would (status 143), but through
    ``SystemExit``, so ``serve``'s cleanup removes its lock file."""
    raise SystemExit(128 + signum)


class _DeferSignals(list):
    """The SIGTERM / SIGINT handler of one ``serve`` call once its checks have passed and before
    ``run_server`` installs its own handlers: each signal is kept in this list (``run_server``
    drains at once when it finds one), so no exception can leave the lock file behind between
    the two. One per call: a signal kept by an earlier in-process ``serve`` never drains a later one."""

    def __call__(self, signum, frame) -> None:
        self.append(signum)


@click.command()
@socket_option
@click.option("--host", default=None, help="Also listen on TCP at this host (needs --port; default 127.0.0.1).")
@click.option("--port", default=None, type=click.IntRange(1, 65535),
              help="Also listen on TCP at this port (off by default).")
@click.option("--api-key-file", default=None, metavar="PATH",
              help="File holding the key TCP clients must send as 'Authorization: Bearer KEY' (else $LLMD_API_KEY; "
                   "needed for a non-loopback --host; the Unix socket needs none).")
@click.option("--api-key", default=None, metavar="KEY",
              help="The key itself (as vLLM and llama-server; visible to local users in /proc: prefer the file "
                   "or $LLMD_API_KEY).")
@click.option("--served-model-name", default=None,
              help="Model id in the API, the only name the `model` field accepts (default: the --model name; "
                   "a GGUF path's file name without .gguf).")
@click.option("--drain-timeout", default=30.0, show_default=True, type=float,
              help="Seconds in-flight requests get on shutdown before they are aborted.")
@click.option("--metrics-compat", default=None, type=click.Choice(["vllm"]),
              help="Also export GET /metrics under vLLM's names (vllm: prefix) for existing dashboards.")
@click.option("--health-stall-timeout", default=DEFAULT_STALL_TIMEOUT_S, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Seconds without a finished engine step after which GET /health answers 503 (stalled).")
@click.option("--kv-role", type=click.Choice(["both", "producer", "consumer"]), default="both", show_default=True,
              help="Prefill/decode disaggregation (vLLM's kv_transfer_params): producer = prefill and pin the KV for a "
                   "consumer to pull over TCP; consumer = pull it and decode; both = no disaggregation.")
@click.option("--kv-pin-timeout", default=60.0, show_default=True, type=float,
              help="Producer: seconds unpulled KV stays pinned.")
@click.option("--kv-pull-timeout", default=30.0, show_default=True, type=float,
              help="Consumer: seconds a KV pull may take before the consumer computes the prefill itself.")
@click.option("--kv-advertise-host", default=None,
              help="Producer: the address consumers pull from (remote_host; default --host).")
@click.option("--kv-producer", "kv_producers", multiple=True, metavar="HOST:PORT",
              help="Consumer: a producer it may pull from (repeatable; the pull carries this daemon's key). "
                   "Default: loopback producers only.")
@engine_options
@one_line_errors
def serve(socket_path, host, port, api_key_file, api_key, served_model_name, drain_timeout, metrics_compat,
          health_stall_timeout, kv_role, kv_pin_timeout, kv_pull_timeout, kv_advertise_host, kv_producers,
          **engine_kw):
    """Run the daemon: OpenAI-style HTTP API on a Unix socket (SIGTERM or `llmd stop` ends it)."""
    from llmd.daemon.protocol import lock_path, unlock_file
    from llmd.daemon.serving.access import check_bind, check_listen, resolve_api_key
    from llmd.daemon.serving.kv_transfer.config import check_role_flags
    from llmd.daemon.serving.socket_claim import claim_socket

    check_role_flags(kv_role, given_options(click.get_current_context(), "kv_pin_timeout", "kv_pull_timeout",
                                            "kv_advertise_host", "kv_producers"))
    if host is not None and port is None:
        raise LlmdError("--host needs --port")
    if port is None and (api_key is not None or api_key_file is not None):
        raise LlmdError("--api-key/--api-key-file guard the TCP listener: they need --port (the socket needs no key)")
    key, warnings = resolve_api_key(api_key, api_key_file)
    for line in warnings:
        click.echo(line, err=True)
    if port is not None:
        check_bind(host or "127.0.0.1", port, key)
        check_listen(host or "127.0.0.1", port)  # a port in use: one line now, not after the lock and load
    path = socket_path_of(socket_path)
    # the lock first, before torch is imported (~2 s): from here `llmd status` / `llmd stop` see a
    # daemon starting, and a second `llmd serve` on the path is refused at once. Until run_server
    # takes SIGTERM over (its drain), `llmd stop` on a starting daemon ends it, removing its lock file.
    main_thread = threading.current_thread() is threading.main_thread()  # signal.signal's condition
    sigint, deferred = signal.getsignal(signal.SIGINT), _DeferSignals()
    sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None

    def restore() -> None:  # the caller's handlers back, however serve ends (an in-process caller keeps its own)
        if main_thread:
            signal.signal(signal.SIGTERM, sigterm)
            signal.signal(signal.SIGINT, sigint)

    try:
        lock_fd = claim_socket(path)
    except BaseException:  # refused
        restore()
        raise
    try:
        kv_transfer = None
        if kv_role != "both":
            from llmd.daemon.serving.kv_transfer.config import KVTransferConfig

            kv_transfer = KVTransferConfig(kv_role, kv_advertise_host or host or "127.0.0.1", port, key,
                                           kv_pin_timeout, kv_pull_timeout, producers=tuple(kv_producers)).check()
        from llmd.daemon.core.config import EngineConfig
        from llmd.daemon.core.prompt_check import check_options_before_load
        from llmd.daemon.serving.lifecycle import run_server

        check_options_before_load(EngineConfig(**engine_kw).resolve())  # one line, before anything loads
        if main_thread:  # from here a signal is kept for run_server, which drains: no lock file left behind
            signal.signal(signal.SIGTERM, deferred)
            signal.signal(signal.SIGINT, deferred)
    except BaseException:
        unlock_file(lock_path(path), lock_fd)  # a bad option: no lock file left behind
        restore()
        raise
    import setproctitle

    setproctitle.setproctitle(serve_title(sys.argv))  # ps: `llmd serve ...`, not `python3 -c ...`
    # its lines and log go on (to /dev/null) once their reader has gone: `llmd serve 2>&1 | head -1`
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[DaemonLogHandler()])
    # one served name: the `model` field accepts exactly what /v1/models lists (vLLM's rule)
    model_id = served_model_name or served_id(engine_kw["model"])
    # the engine loads on the engine loop's thread, the one that runs its steps (see engine_loop)
    try:
        left_behind = asyncio.run(run_server(
            lambda: build_engine(name=model_id, echo=echo_err, **engine_kw), path, model_id, (model_id,),
            host=host, port=port, drain_timeout=drain_timeout, lock_fd=lock_fd, metrics_compat=metrics_compat,
            api_key=key if port is not None else None, health_stall_timeout=health_stall_timeout,
            kv_transfer=kv_transfer, freeze_gc=True,  # this process is the daemon's own
            deferred_signals=deferred, echo=echo_err))
    finally:  # also when run_server failed before its handlers took over (a bind): not the deferral
        restore()
    if left_behind and main_thread:  # llmd serve's process (an in-process caller on the main thread exits with it)
        _exit_past_the_engine_thread()


def _exit_past_the_engine_thread() -> None:
    """Exit 0 at once, output flushed: ``run_server`` returned with its engine thread still
    running (a shutdown while the model loads: a load cannot be interrupted and is not waited
    for; or a step past the 10 s stop; the socket and lock file are gone already). Python's exit
    would finalize the interpreter under that thread, which then ends itself inside torch's C++
    frames at its next GIL take and aborts the process (``terminate called without an active
    exception``, exit -6 instead of a drain's 0)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left, a closed stream: nothing more to say
            pass
    os._exit(0)


@click.command()
@socket_option
@one_line_errors
def ps(socket_path):
    """Running and waiting requests of the daemon."""
    from llmd.daemon.protocol import check_stats_schema

    st = client_for(socket_path).stats()
    check_stats_schema(st)
    click.echo(f"{'ID':<36}{'STATE':<9}{'PROMPT':>7}{'CACHED':>7}{'GEN':>6}{'BLOCKS':>7}{'TTFT s':>8}{'AGE s':>7}")
    for r in st["requests"]:
        ttft = "-" if r["ttft_s"] is None else f"{r['ttft_s']:.2f}"
        click.echo(f"{r['id']:<36}{r['state']:<9}{r['prompt_tokens']:>7}{r['cached_tokens']:>7}"
                   f"{r['generated_tokens']:>6}{r['blocks']:>7}{ttft:>8}{r['age_s']:>7.1f}")


@click.command()
@socket_option
@one_line_errors
def status(socket_path):
    """Model, KV dtype, the engine (dtype, attention kernels, threads, how the linears are packed),
    blocks used/total, prefix-cache hit rate, uptime."""
    from llmd.daemon.client.spawn import starting_pid
    from llmd.daemon.protocol import check_stats_schema

    c = client_for(socket_path)
    health = c.health(ready_only=False) or {}
    if not health and (pid := starting_pid(c.socket_path)) is not None:
        click.echo(f"daemon:      {c.socket_path} (pid {pid}), starting: its socket is not up yet "
                   "(`llmd status` again in a moment)")
        return
    if health.get("status") == "loading":  # /v1/stats answers 503 until the engine is built
        click.echo(f"daemon:      {c.socket_path} (pid {health['pid']}), up {health.get('uptime_s', 0):.0f} s, "
                   "loading the model (`llmd status` again once it is up)")
        click.echo(f"model:       {health.get('model', '?')}")
        return
    st = c.stats()
    check_stats_schema(st)
    kv, pc, sc = st["kv_cache"], st["prefix_cache"], st["scheduler"]
    hit = f"{pc['hits'] / pc['queries']:.1%}" if pc["queries"] else "n/a"
    pid = health.get("pid") or c.health(ready_only=False)["pid"]
    draining = (", shutting down: in-flight requests finish, new ones get 503"
                if health.get("status") == "draining" else "")
    click.echo(f"daemon:      {c.socket_path} (pid {pid}), up {st['uptime_s']:.0f} s{draining}")
    click.echo(f"model:       {st['model']}, KV cache dtype {st['kv_cache_dtype']}")
    if st.get("runtime"):  # absent from daemons before 2026-12-07
        click.echo(f"engine:      {st['runtime']}")
    cached = f", {kv['cached_free']} free ones holding prefix-cache KV" if kv.get("cached_free") else ""
    click.echo(f"KV blocks:   {kv['used']}/{kv['total']} used ({kv['usage']:.1%}){cached}, "
               f"block size {kv['block_size']}")
    click.echo(f"prefix hits: {hit} ({pc['hits']}/{pc['queries']} tokens)")
    shifts = f", {sc['context_shifts']} context shifts" if sc.get("context_shifts") else ""
    click.echo(f"requests:    {sc['running']} running, {sc['waiting']} waiting{shifts}; "
               f"{st['throughput']['generation_tokens_per_s']:.1f} gen tok/s over the last 5 s")


@click.command()
@socket_option
@click.option("--timeout", default=60.0, show_default=True, type=float, help="Seconds to wait for the daemon to exit.")
@one_line_errors
def stop(socket_path, timeout):
    """Stop the daemon gracefully (in-flight requests finish or are aborted after its drain timeout);
    returns once the process has exited, so `llmd serve` can start again at once."""
    from llmd.daemon.client.spawn import lock_held, starting_pid, wait_for_daemon_exit
    from llmd.daemon.protocol import lock_path

    c = client_for(socket_path)
    health = c.health(ready_only=False)  # a loading daemon (503) stops too
    pid = starting_pid(c.socket_path) if health is None else None
    if pid is not None:  # still starting (no socket yet): SIGTERM ends it before it serves
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        click.echo(f"llmd: stopping the daemon on {c.socket_path} (pid {pid}), which was still starting", err=True)
        health = {"pid": pid}
    elif health is None:
        # a daemon at the end of its drain (listeners closed) holds its lock and socket file until
        # it exits: wait for that too, so `llmd stop && llmd serve` works
        if not (os.path.exists(c.socket_path) and lock_held(lock_path(c.socket_path))):
            click.echo(f"llmd: no daemon running on {c.socket_path}")
            return
        click.echo(f"llmd: the daemon on {c.socket_path} is already shutting down; waiting for it to exit", err=True)
    elif health.get("status") == "draining":  # stopping already: its drain goes on, nothing to send
        click.echo(f"llmd: the daemon on {c.socket_path} is already shutting down; waiting for it to exit", err=True)
    else:
        c.shutdown()
        click.echo(f"llmd: stopping the daemon on {c.socket_path} (pid {health['pid']}); in-flight requests get "
                   f"its drain timeout", err=True)
    if not wait_for_daemon_exit(c.socket_path, timeout, (health or {}).get("pid")):
        raise LlmdError(f"the daemon on {c.socket_path} did not exit within {timeout:.0f} s")
    click.echo("llmd: daemon stopped")
