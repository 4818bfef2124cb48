"""Real daemons in subprocesses for the server tests (fixtures re-exported by conftest.py).

Two daemons per session, loaded in parallel (each ~20-30 s on 2 CPU cores):

* ``llmd_daemon``: default settings (context 8192, 512 MiB pool), started with ``Popen``;
* ``llmd_small_daemon``: context 2048, 128 MiB pool, drain timeout 1 s, started the way
  ``llmd chat`` starts one (``spawn.ensure_daemon``, called from two threads at once to
  exercise the spawn lock).

Sockets live under ``tempfile.mkdtemp(prefix="llmd", dir="/tmp")`` (short paths; the
AF_UNIX limit is 107 bytes). Finalizers send SIGTERM and wait for the socket to go.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import pytest

from llmd.daemon.client.client import Client

# float32: the tests expect exact greedy tokens (bfloat16, the CPU default where the CPU has it,
# diverges from float32); --threads 1: see DAEMON_ENV.
PINNED = ["--dtype", "float32", "--threads", "1"]
SERVE = [sys.executable, "-c", "from llmd.daemon.cli.main import main; main()", "serve", *PINNED]
SMALL_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--drain-timeout", "1", *PINNED]
START_TIMEOUT_S = 240
# Two daemons and the test process share the CI's 2 cores: one torch thread each (--threads 1,
# and OMP_NUM_THREADS for anything else), or OpenMP's spinning threads oversubscribe the cores
# and small ops get ~10x slower.
DAEMON_ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


@dataclass
class Daemon:
    path: str
    log: str
    pid: int = 0
    spawn_messages: list[str] = field(default_factory=list)

    def client(self, timeout: float = 120.0) -> Client:
        return Client(self.path, timeout=timeout)

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Poll /v1/stats until nothing runs or waits; returns the last stats."""
        c, deadline = self.client(), time.monotonic() + timeout
        while True:
            st = c.stats()
            if not st["requests"] and st["kv_cache"]["used"] == 0:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon not idle after {timeout} s: {st['requests']}, "
                                     f"used {st['kv_cache']['used']}")
            time.sleep(0.05)


def _stop(d: Daemon, timeout: float = 30.0) -> None:
    if not d.pid:
        return
    try:
        os.kill(d.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(d.path) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.kill(d.pid, 0)
        time.sleep(1.0)
        os.kill(d.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _start_small(small: Daemon, errors: list) -> None:
    from llmd.daemon.client.spawn import ensure_daemon

    def one():
        try:
            ensure_daemon(small.path, SMALL_ARGS, small.log, timeout=START_TIMEOUT_S,
                          echo=lambda m, nl=True: small.spawn_messages.append(m), env=DAEMON_ENV)
        except Exception as e:  # reported by the fixture
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()


@pytest.fixture(scope="session")
def llmd_daemons(request):
    """Start both daemons at once; returns (main, small)."""
    tmp = tempfile.mkdtemp(prefix="llmd", dir="/tmp")
    main = Daemon(os.path.join(tmp, "main.sock"), os.path.join(tmp, "main.log"))
    small = Daemon(os.path.join(tmp, "small.sock"), os.path.join(tmp, "small.log"))
    with open(main.log, "wb") as log:
        proc = subprocess.Popen(SERVE + ["--socket", main.path], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                cwd="/", env=DAEMON_ENV)
    main.pid = proc.pid
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))  # runs last
    request.addfinalizer(lambda: (_stop(main), proc.wait(timeout=30)))
    request.addfinalizer(lambda: _stop(small))
    errors: list = []
    starter = threading.Thread(target=_start_small, args=(small, errors))
    starter.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while main.client(timeout=5).health() is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            starter.join()
            raise RuntimeError(f"main daemon did not start:\n{main.log_text()}")
        time.sleep(0.25)
    starter.join()
    if errors:
        raise RuntimeError(f"small daemon did not start: {errors[0]}")
    small.pid = small.client().health()["pid"]
    return main, small


@pytest.fixture(scope="session")
def llmd_daemon(llmd_daemons) -> Daemon:
    return llmd_daemons[0]


@pytest.fixture(scope="session")
def llmd_small_daemon(llmd_daemons) -> Daemon:
    return llmd_daemons[1]
