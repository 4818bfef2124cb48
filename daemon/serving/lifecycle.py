"""``llmd serve``: the daemon's lifecycle around the HTTP app.

Socket: ``$XDG_RUNTIME_DIR/llmd/llmd.sock`` (else ``~/.cache/llmd/llmd.sock``; ``--socket``
or ``$LLMD_SOCKET`` override). Its directory is created 0700 and the socket is bound under
umask 077, so it is 0600 from its first instant and other users cannot connect.

* A lock file ``<socket>.lock`` (``flock``, holding the daemon's pid) is held for the daemon's
  lifetime, taken first thing (:mod:`.socket_claim`): a second daemon on the same path is refused
  even while the first is still importing torch or loading its model. It is
  removed on exit (``protocol.unlock_file``; a lock won on a removed file is taken again).
* A socket file that answers is a live daemon → refused; one that refuses connections is
  stale (a crashed daemon) → replaced. A path over the AF_UNIX limit → a clear error.
* ``SIGTERM`` / ``SIGINT`` / ``POST /v1/shutdown`` (``llmd stop``): drain. New generation
  requests get 503 "the daemon is shutting down" while the listeners stay open, so ``/health``
  answers 200 ``draining``, ``llmd status`` and ``llmd stop`` still reach the daemon, and a
  P/D consumer can still pull KV this producer pinned. In-flight requests finish for
  ``drain_timeout`` seconds, then are aborted (streams get ``finish_reason: "abort"`` and
  ``[DONE]``); a second SIGTERM / SIGINT (a second Ctrl-C) aborts them at once, as uvicorn and
  vLLM's server force the exit. Then the listeners close, the socket is removed, exit 0.
* An optional TCP listener (``--host/--port``), off by default, loopback unless asked; its
  requests go through :mod:`.access` (API key, loopback Host/Origin, JSON bodies). A
  non-loopback host needs a key. A port that cannot be bound (in use, an address not of this
  machine) is one line, the socket and lock file removed, before the engine starts loading.
* A ``--socket`` directory others can write to (not sticky) or own, or a lock file or socket
  of another user, is refused with one line (:func:`prepare_socket_dir`, :func:`claim_socket`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence

from aiohttp import web

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.protocol import lock_path, unlock_file
from llmd.daemon.serving.access import (
    AccessPolicy,
    access_middleware,
    check_bind,
    is_loopback_host,
    listen_error,
)
from llmd.daemon.serving.api import ServerState, make_app
from llmd.daemon.serving.connections import ServingRunner
from llmd.daemon.serving.engine_health import DEFAULT_STALL_TIMEOUT_S
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.metrics import DaemonMetrics
from llmd.daemon.serving.socket_claim import (  # noqa: F401 (re-exported: this module's names before)
    claim_socket,
    prepare_socket_dir,
    socket_is_live,
)

log = logging.getLogger("llmd.serve")


async def _until_ready(eloop: EngineLoop, state: ServerState):
    """The engine once built (the factory's exception propagates), or None when a shutdown
    comes first. ``eloop.ready`` itself is never cancelled (the engine thread resolves it)."""
    ready = asyncio.wrap_future(eloop.ready)
    stop = asyncio.ensure_future(state.shutdown.wait())
    try:
        await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    return ready.result() if ready.done() else None


async def run_server(engine, socket_path: str, model_id: str, model_ids: tuple[str, ...], *,
                     host: str | None = None, port: int | None = None, drain_timeout: float = 30.0,
                     lock_fd: int | None = None, metrics_compat: str | None = None, api_key: str | None = None,
                     health_stall_timeout: float = DEFAULT_STALL_TIMEOUT_S, kv_transfer=None, echo=print,
                     freeze_gc: bool = False, deferred_signals: Sequence[int] = ()) -> bool:
    """Serve until SIGTERM/SIGINT or ``POST /v1/shutdown``; then drain and clean up. Returns
    True when the engine thread was left running (a shutdown while the model loaded: a load is
    not waited for, or a loaded engine's thread past its 10 s stop), else False.

    Args:
        engine: a loaded :class:`Engine`, or a zero-argument factory of one, handed to a fresh
            :class:`EngineLoop`. Give the factory: the engine then loads on the thread that
            runs its steps, which on CPU is worth ~1.4× throughput (see ``engine_loop``).
            The factory's exception propagates from here.
        socket_path: where to bind (claimed with :func:`claim_socket` first).
        model_id, model_ids: the served id and every name accepted as ``model`` (what
            ``/health`` lists; the GGUF's own ``general.name`` is not added).
        host, port: optional TCP listener, guarded by :mod:`.access` (loopback ``Host`` and
            ``Origin`` on a loopback bind, ``application/json`` bodies, and ``api_key``).
        api_key: the Bearer token TCP requests need (None: none; then only a loopback host).
        drain_timeout: seconds in-flight requests get to finish before being aborted.
        lock_fd: the descriptor :func:`claim_socket` returned, if the caller claimed the path
            already (before loading the model, to fail fast); claimed here otherwise.
        metrics_compat: None, or "vllm" to also export ``GET /metrics`` under vLLM's names.
        health_stall_timeout: seconds without a finished engine step after which ``/health``
            answers 503 ``stalled`` (``engine_health.py``).
        kv_transfer: a checked :class:`~llmd.daemon.serving.kv_transfer.config.KVTransferConfig`
            (``--kv-role`` producer / consumer), or None.
        freeze_gc: once a factory has built the engine, ``gc.collect()`` + ``gc.freeze()``
            (:func:`~llmd.daemon.serving.engine_loop.freeze_startup_heap`); ``llmd serve`` sets it,
            in-process callers (tests) leave it off.
        deferred_signals: a live list the caller's own SIGTERM / SIGINT handler appends to
            until this function's handlers replace it (``llmd serve``, from its checks on):
            non-empty once they are installed, it drains at once, as the signal would have.

    The socket (and TCP listener) is bound *before* the engine is ready: while it loads on
    its thread, ``/health`` answers 503 ``loading`` (every other route but ``/metrics`` and
    ``/v1/shutdown`` 503 too), so clients wait for a 200, not for a connectable socket, and a
    SIGTERM or ``llmd stop`` during loading ends the daemon cleanly.
    Raises:
        LlmdError: a non-loopback ``host`` without ``api_key`` (:func:`check_bind`), before
            anything is claimed or loaded; a socket path :func:`claim_socket` refuses; a listener
            that cannot be bound (a port in use: :func:`_listen`), before the engine starts
            loading, with the socket and lock file removed.
    """
    host = host or "127.0.0.1"
    if port is not None:
        check_bind(host, port, api_key)
    if lock_fd is None:
        lock_fd = claim_socket(socket_path)
    loop = asyncio.get_running_loop()
    try:
        metrics = DaemonMetrics(model_id, metrics_compat)
        eloop = EngineLoop(engine, model_id, metrics=metrics, freeze_gc=freeze_gc)  # started once listening
        state = ServerState(engine_loop=eloop, model_id=model_id, model_ids=model_ids, vocab_size=0, max_model_len=0,
                            shutdown=asyncio.Event(), metrics=metrics, health_stall_timeout=health_stall_timeout,
                            loaded=False, kv_transfer=kv_transfer)  # filled in once the engine is ready
        access = access_middleware(AccessPolicy(api_key, is_loopback_host(host))) if port is not None else None
        runner = ServingRunner(make_app(state, access), state.limits, handler_cancellation=True, access_log=None,
                               shutdown_timeout=2.0)
        await runner.setup()
        try:
            await _listen(runner, socket_path, host, port)
        except BaseException:
            await runner.cleanup()
            raise
    except BaseException:  # nothing loaded yet: no socket or lock file left behind
        _release(socket_path, lock_fd)
        raise
    eloop.start()  # the engine loads (a factory) only once the listeners are up
    force = asyncio.Event()  # a second signal: abort what is in flight now

    def on_signal() -> None:
        if state.shutdown.is_set() and not force.is_set():
            echo("llmd: second signal: aborting the requests in flight now")
            force.set()
        state.shutdown.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    if deferred_signals:  # one came before the handlers above: act on it now
        on_signal()
    try:
        engine = await _until_ready(eloop, state)
        if engine is not None:  # None: a shutdown while loading, nothing was served
            state.vocab_size, state.max_model_len = engine.model_config.vocab_size, engine.max_model_len
            state.loaded = True
            summary = f"; {engine.runtime_summary()}" if hasattr(engine, "runtime_summary") else ""
            tcp = f" and http://{host}:{port}{' (API key required)' if api_key else ''}" if port is not None else ""
            echo(f"llmd: serving {model_id} on {socket_path}{tcp}"
                 + f" (pid {os.getpid()}{summary})")
            await state.shutdown.wait()
            echo(f"llmd: shutting down; {eloop.num_live} sequence{'' if eloop.num_live == 1 else 's'} in flight "
                 f"(drain timeout {drain_timeout:.0f} s)")
            state.draining = True  # new generation requests: 503; the listeners stay open until the drain ends
            deadline = loop.time() + drain_timeout
            while eloop.num_live and loop.time() < deadline and not force.is_set():
                await asyncio.sleep(0.05)
            if eloop.num_live:
                why = "second signal" if force.is_set() else f"drain timeout ({drain_timeout:.0f} s)"
                echo(f"llmd: {why}: aborting {eloop.num_live} sequence{'' if eloop.num_live == 1 else 's'} in flight")
                await asyncio.wait_for(asyncio.wrap_future(eloop.abort_all()), 10.0)
                await asyncio.sleep(0.2)  # let the handlers write finish_reason "abort" and [DONE]
    finally:
        await runner.cleanup()
        ended = eloop.stop(10.0 if state.loaded else 0.0)  # a loading engine cannot be interrupted: not waited for
        _release(socket_path, lock_fd)  # before the handlers go: a SIGTERM here would kill with the files left
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        echo("llmd: stopped")
    return not ended


async def _listen(runner: ServingRunner, socket_path: str, host: str, port: int | None) -> None:
    """Start the Unix socket's site (0600 from its first instant) and the TCP one if ``port``.

    Raises:
        LlmdError: a bind fails (a port in use, an address not of this machine): one line naming
            the address and the OS's reason, instead of asyncio's OSError traceback.
    """
    old_umask = os.umask(0o077)
    try:
        await web.UnixSite(runner, socket_path).start()
    except OSError as e:
        raise LlmdError(f"cannot listen on {socket_path}: {os.strerror(e.errno) if e.errno else e}") from None
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, 0o600)
    if port is not None:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            raise LlmdError(listen_error(host, port, e)) from None


def _release(socket_path: str, lock_fd: int) -> None:
    """Remove the socket file and ``<socket>.lock`` (then release the lock)."""
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    unlock_file(lock_path(socket_path), lock_fd)  # removes <socket>.lock, then releases it
