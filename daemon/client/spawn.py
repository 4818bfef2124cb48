"""Make sure a daemon runs on a socket, and wait for one to exit (``llmd chat``, ``llmd stop``).

No daemon on the socket → :func:`ensure_daemon` starts one in the background (``llmd serve``,
its own session, logging to ``~/.cache/llmd/daemon.log``, created 0600 in a 0700 directory) under a lock
(``<socket>.spawn.lock``, removed once the daemon answers) so two clients never both spawn one, with progress until
``/health`` answers. That daemon keeps running after the client exits; ``llmd stop`` ends it
(:func:`wait_for_daemon_exit` returns once the process is gone).

The daemon holds ``<socket>.lock`` (``flock``) from before it loads its model until its
process exits, and removes it then; :func:`lock_held` probes it. The daemon side of the lock is
``llmd.daemon.serving.lifecycle.claim_socket``; both name it through :mod:`llmd.daemon.protocol`.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import click

from llmd.daemon.client.client import Client
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.protocol import default_log_path, lock_file, lock_path, spawn_lock_path, unlock_file

STARTUP_TIMEOUT_S = 300.0
#: how a client starts a daemon: the ``llmd`` console script's entry point, by name (not imported)
SERVE_COMMAND = [sys.executable, "-c", "from llmd.daemon.cli.main import main; main()", "serve"]


def engine_args(engine_kw: dict) -> list[str]:
    """Engine options as ``llmd serve`` arguments (None values dropped, flags as bare switches)."""
    args = []
    for k, v in engine_kw.items():
        if v is None or v is False:
            continue
        args.append("--" + k.replace("_", "-"))
        if v is not True:
            args.append(",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v))
    return args


def lock_held(path: str) -> bool:
    """Whether another process holds the ``flock`` on ``path`` (a daemon's ``<socket>.lock``
    is held from before it loads the model until the process exits)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an exited child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def starting_pid(socket_path: str) -> int | None:
    """The pid of a daemon that holds ``<socket>.lock`` but has no socket file yet (``llmd serve``
    between taking its lock, first thing, and binding its socket: importing torch, checking its
    options), read from the lock file (:func:`llmd.daemon.serving.socket_claim.claim_socket`
    writes it); None when no such daemon (or the file holds no pid).

    The lock is probed (taken and dropped at once) only once the file names a live process: the
    daemon writes its pid after taking the lock, so a probe never makes a daemon that is taking
    it that moment fail ("another llmd daemon is already running"), however often clients call
    this while it starts (every failed connection does, :func:`llmd.daemon.client.client.unavailable`)."""
    if os.path.exists(socket_path):
        return None
    try:
        with open(lock_path(socket_path)) as f:
            text = f.read(32).strip()
    except OSError:
        return None
    pid = int(text) if text.isdigit() and int(text) > 0 else None
    if pid is None or not pid_running(pid) or not lock_held(lock_path(socket_path)):
        return None
    return pid


def wait_for_daemon_exit(socket_path: str, timeout: float, pid: int | None = None) -> bool:
    """Wait until the daemon on ``socket_path`` has exited: its socket file is gone (removed
    first, on shutdown), its ``<socket>.lock`` is released (so a new ``llmd serve`` on the path
    can start at once) and, given its ``pid`` (``/health``), the process is gone (its memory
    returned). Returns False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (os.path.exists(socket_path) or lock_held(lock_path(socket_path))
           or (pid is not None and pid_running(pid))):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _tighten(fd: int, mode: int) -> None:
    """``fchmod`` to ``mode`` a file of this user's that group or others may access."""
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.fchmod(fd, mode)


def open_log(log_path: str):
    """``log_path`` opened for appending (binary), created 0600 in a directory created 0700:
    a daemon's log is for its owner only. The default log's directory (llmd's cache directory,
    as ``models.paths.ensure_cache_dir`` makes it) and an existing log of this user's that
    others can read are tightened to 0700 / 0600."""
    d = os.path.dirname(os.path.abspath(log_path))
    os.makedirs(d, mode=0o700, exist_ok=True)
    if d == os.path.dirname(os.path.abspath(default_log_path())):
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _tighten(dfd, 0o700)
        finally:
            os.close(dfd)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    _tighten(fd, 0o600)
    return os.fdopen(fd, "ab")


def _tail(path: str, n: int = 5, start: int = 0) -> str:
    """The last ``n`` lines of ``path`` after byte offset ``start``."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return "".join(f.read().decode(errors="replace").splitlines(True)[-n:]).strip()
    except OSError:
        return ""


def serving_body(health: dict | None) -> dict | None:
    """``health`` (a ``/health`` body, 200's or 503's, or None) when it says the daemon is ready
    and takes new requests (``status`` ``ok``), else None: 200 ``draining`` (after SIGTERM /
    ``llmd stop``), 503 ``loading`` / ``dead`` / ``stalled``, or nothing answered."""
    return health if health and health.get("status") == "ok" else None


def serving(client: Client) -> dict | None:
    """``/health``'s body when the daemon is ready and takes new requests, else None (nothing
    answers, it loads, or it is draining): :func:`serving_body` of one ask."""
    return serving_body(client.health())


def ensure_daemon(socket_path: str, serve_args: list[str], log_path: str | None = None,
                  timeout: float = STARTUP_TIMEOUT_S, echo=lambda m, nl=True: click.echo(m, err=True, nl=nl),
                  env: dict | None = None, live_progress: bool | None = None,
                  ready_health: dict | None = None) -> Client:
    """Return a client of a healthy daemon on ``socket_path``, starting one if needed.

    ``env`` is the spawned daemon's environment (default: this process's). ``live_progress``:
    redraw one progress line with ``\r`` (default: when stderr is a terminal; otherwise a plain
    line every 10 s, readable in logs and pipes). ``ready_health``: a ``/health`` body the caller
    has just read that says the daemon serves (:func:`serving_body`'s answer; ``llmd chat``'s one
    ask at start): the client is returned without asking again.

    Raises:
        LlmdError: the daemon could not start (its log's last lines are in the message) or
            did not answer ``/health`` within ``timeout`` seconds.
    """
    client = Client(socket_path)
    if ready_health is not None or serving(client):
        return client
    old = client.health()
    if old:  # draining (SIGTERM, `llmd stop`): it refuses new requests; a new daemon follows it
        echo(f"llmd: the daemon on {socket_path} is shutting down; waiting for it to exit")
        if not wait_for_daemon_exit(socket_path, timeout, old.get("pid")):
            raise LlmdError(f"the daemon on {socket_path} is shutting down but did not exit within {timeout:.0f} s")
    log_path = log_path or default_log_path()
    os.makedirs(os.path.dirname(os.path.abspath(socket_path)), mode=0o700, exist_ok=True)
    lock_fd = lock_file(spawn_lock_path(socket_path))  # a second chat waits here, then finds the daemon
    try:
        if serving(client):
            return client
        proc, log_start, starting = None, 0, None
        if client.health(ready_only=False) is None:  # nothing answers (one that answers 503 is loading)
            starting = starting_pid(socket_path)
        if starting is not None:  # an `llmd serve` holds the lock and has no socket yet: wait for it
            echo(f"llmd: the daemon on {socket_path} (pid {starting}) is starting; waiting for it")
        elif client.health(ready_only=False) is None:
            with open_log(log_path) as log:
                log_start = log.tell()  # the log is appended to: progress shows this daemon's lines only
                cmd = [*SERVE_COMMAND, "--socket", socket_path, *serve_args]
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        start_new_session=True, cwd="/", env=env)
            echo(f"llmd: starting a daemon (pid {proc.pid}, log {log_path}); it keeps running after this chat, "
                 "`llmd stop` ends it")
        t0, next_line = time.monotonic(), 0.0
        live = sys.stderr.isatty() if live_progress is None else live_progress
        while not client.health():  # a 200: a 503 (loading) is not ready yet
            elapsed = time.monotonic() - t0
            if proc is not None and proc.poll() is not None and not lock_held(lock_path(socket_path)):
                raise LlmdError(f"the daemon exited with code {proc.returncode}; see {log_path}: "
                                f"{_tail(log_path, 3, log_start)}")
            state = client.health(ready_only=False) or {}
            if starting is not None and not state and not lock_held(lock_path(socket_path)):
                raise LlmdError(f"the daemon that was starting on {socket_path} (pid {starting}) exited before it "
                                "served; run the command again to start one")
            if state.get("status") in ("dead", "stalled"):
                raise LlmdError(f"the daemon on {socket_path} is unhealthy ({state.get('reason')}); see {log_path}")
            if elapsed > timeout:
                raise LlmdError(f"the daemon did not answer within {timeout:.0f} s; see {log_path}")
            # the log's last line, but not for an `llmd serve` started elsewhere (its output is not in this log)
            last = "" if starting is not None else (_tail(log_path, 1, log_start).splitlines()[-1:] or [""])[0][:70]
            if live:  # one line redrawn in place
                echo(f"\rllmd: waiting for the daemon ({elapsed:4.0f} s) {last:<70}", nl=False)
            elif elapsed >= next_line:  # a log or pipe: a plain line every 10 s
                echo(f"llmd: waiting for the daemon ({elapsed:.0f} s) {last}")
                next_line += 10
            time.sleep(0.25)
        echo(f"\rllmd: daemon ready after {time.monotonic() - t0:.1f} s{' ' * 70}" if live
             else f"llmd: daemon ready after {time.monotonic() - t0:.1f} s")
        return client
    finally:
        unlock_file(spawn_lock_path(socket_path), lock_fd)  # no <socket>.spawn.lock left behind


def reconnect(socket_path: str, serve_args: list[str], log_path: str | None = None,
              exit_timeout: float = 60.0, **kw) -> Client:
    """A client of a daemon on ``socket_path`` again after the last one went away mid-session
    (``llmd chat``'s next message): wait up to ``exit_timeout`` seconds for the old process to
    release ``<socket>.lock`` (a crashed one released it at once and its stale socket is
    replaced), unless a daemon answers again, then :func:`ensure_daemon` (``kw``: its options)
    finds or starts one as at first (after a draining one, which still answers, has exited).

    Raises:
        LlmdError: the old daemon did not exit in time, or :func:`ensure_daemon`'s errors.
    """
    client, deadline = Client(socket_path), time.monotonic() + exit_timeout
    while lock_held(lock_path(socket_path)) and client.health(ready_only=False) is None:
        if time.monotonic() > deadline:
            raise LlmdError(f"the daemon on {socket_path} stopped answering but did not exit within "
                            f"{exit_timeout:.0f} s")
        time.sleep(0.1)
    return ensure_daemon(socket_path, serve_args, log_path, **kw)


def check_running_daemon(client: Client, model: str | None, ignored: list[str],
                         echo=lambda m: click.echo(m, err=True), health: dict | None = None) -> None:
    """Before chatting with a daemon that was already running: its engine options are fixed.

    Args:
        model: the ``--model`` given on this command line (None = not given).
        ignored: other engine options given on this command line (``--kv-cache-dtype`` ...).
        health: the daemon's ``/health`` body, when the caller has just read it (else asked here).
    Raises:
        LlmdError: ``model`` is not one of the names the daemon serves (``/health`` ``model_ids``).
    """
    health = (health if health is not None else client.health()) or {}
    served = health.get("model_ids") or [health.get("model")]
    stop = f"`llmd stop --socket {client.socket_path}`"
    if model is not None and model not in served:
        raise LlmdError(f"the daemon on {client.socket_path} serves {served[0]!r}, not {model!r}: stop it with "
                        f"{stop}, or start another with --socket PATH")
    if ignored:
        verb = "applies" if len(ignored) == 1 else "apply"
        echo(f"llmd: a daemon already runs on {client.socket_path}; {', '.join(ignored)} {verb} only when "
             f"`llmd chat` starts one ({stop} first)")
