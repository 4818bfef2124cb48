"""``llmd bench startup``: cold and warm starts of ``llmd serve`` (and ``llmd kv-size``), side by side.

Every start is a fresh process ``llmd serve --model M [serve args]`` on the default socket of
its own temporary ``$XDG_RUNTIME_DIR``, timed from ``Popen`` to the first ``GET /health`` 200
(polled every :data:`POLL_S` seconds; 503 while it loads), then stopped with SIGTERM:

* **cold**: a fresh, empty ``$XDG_CACHE_HOME`` each run: the GGUF header is parsed, the
  tokenizer built from the GGUF and the weights converted (and all three cached), as on a first
  start after install;
* **warm**: the second start of the same model and settings: the cache of the last cold run;
* **uncached** (``--modes`` adds it): the warm caches but ``LLMD_WEIGHTS_CACHE=0``, so the
  weights are converted again, as every start did before the converted-weights cache.

Each row shows the median, min and max over ``--runs`` of the wall seconds and of the CPU
seconds the process had used at that moment (user + system of all its threads, from
``/proc/<pid>/stat``: what ``/usr/bin/time`` would count up to then); the last column is the
median wall relative to the warm start's. ``llmd kv-size`` runs the same way (exit, CPU from
``wait4``). A model name is resolved here first, so a chunked model (Gemma 3) is assembled
once in the user's cache and every run gets its path.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

POLL_S = 0.02
CLI = [sys.executable, "-c", "from llmd.daemon.cli.main import main; main()"]


@dataclass
class Timings:
    """One row: the wall and CPU seconds of each run."""

    name: str
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def health_ok(path: str, timeout: float = 1.0) -> bool:
    """True when ``GET /health`` on the Unix socket ``path`` answers 200."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: llmd\r\nConnection: close\r\n\r\n")
        return s.recv(64).split(b" ")[1:2] == [b"200"]
    except (OSError, IndexError):
        return False
    finally:
        s.close()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a live process has used (all threads), from ``/proc``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_serve(argv: list[str], env: dict, timeout: float) -> tuple[float, float]:
    """(wall s, CPU s) of one ``llmd serve`` to its first ``/health`` 200 on the default socket of
    a fresh ``$XDG_RUNTIME_DIR``. Raises RuntimeError (with the log's tail) if it exits or times out."""
    runtime = tempfile.mkdtemp(prefix="llmd-bench-run-")
    log_path = os.path.join(runtime, "serve.log")
    sock = os.path.join(runtime, "llmd", "llmd.sock")
    try:
        with open(log_path, "w") as log:
            t0 = time.monotonic()
            proc = subprocess.Popen([*CLI, "serve", *argv], env={**env, "XDG_RUNTIME_DIR": runtime},
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/")
            try:
                while not health_ok(sock):
                    if proc.poll() is not None or time.monotonic() - t0 > timeout:
                        raise RuntimeError(f"llmd serve did not become ready: {_tail(log_path)}")
                    time.sleep(POLL_S)
                wall, cpu = time.monotonic() - t0, process_cpu_s(proc.pid)
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        return wall, cpu
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def time_command(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall s, CPU s) of one ``llmd ARGV`` run to its exit. Raises RuntimeError if it fails."""
    t0 = time.monotonic()
    proc = subprocess.Popen([*CLI, *argv], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd="/")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"llmd {' '.join(argv)} failed: {err.strip()[-500:]}")
    return wall, usage.ru_utime + usage.ru_stime


def _tail(path: str, n: int = 600) -> str:
    with open(path) as f:
        return f.read()[-n:].strip()


def run_startup_bench(model_path: str, serve_args: list[str], runs: int, modes: tuple[str, ...],
                      timeout: float = 600.0, echo=print) -> list[Timings]:
    """Time ``runs`` starts per mode (module docstring), interleaved run by run (cold, warm,
    uncached, kv-size, then again), so load from other processes spreads over every row.
    Returns the rows (``modes`` order, then ``kv-size``); prints them with :func:`report`."""
    argv = ["--model", model_path, *serve_args]
    rows = {m: Timings(m) for m in (*modes, "kv-size")}
    base = {k: v for k, v in os.environ.items() if k not in ("LLMD_SOCKET", "LLMD_WEIGHTS_CACHE")}
    last_cache = None
    try:
        for i in range(runs):
            cache = tempfile.mkdtemp(prefix="llmd-bench-cache-")  # this run's cold cache, then its warm one
            for mode in modes:
                env = {**base, "XDG_CACHE_HOME": cache}
                if mode == "uncached":
                    env["LLMD_WEIGHTS_CACHE"] = "0"
                wall, cpu = time_serve(argv, env, timeout)
                rows[mode].wall.append(wall)
                rows[mode].cpu.append(cpu)
                echo(f"run {i + 1}/{runs} {mode}: {wall:.2f} s wall, {cpu:.2f} s CPU")
            wall, cpu = time_command(["kv-size", "--model", model_path], {**base, "XDG_CACHE_HOME": cache})
            rows["kv-size"].wall.append(wall)
            rows["kv-size"].cpu.append(cpu)
            if last_cache:
                shutil.rmtree(last_cache, ignore_errors=True)
            last_cache = cache
    finally:
        if last_cache:
            shutil.rmtree(last_cache, ignore_errors=True)
    out = list(rows.values())
    for line in report(out):
        echo(line)
    return out


def report(rows: list[Timings]) -> list[str]:
    """The table: per row median [min-max] wall and CPU seconds, and median wall / warm's."""
    warm = next((r for r in rows if r.name == "warm"), None)
    ref = statistics.median(warm.wall) if warm and warm.wall else None
    lines = [f"{'start':<10}{'wall s median [min-max]':>26}{'CPU s median [min-max]':>26}{'x warm':>9}"]
    for r in rows:
        ratio = f"{statistics.median(r.wall) / ref:>8.2f}x" if ref else f"{'-':>9}"
        lines.append(f"{r.name:<10}{_span(r.wall):>26}{_span(r.cpu):>26}{ratio}")
    return lines


def _span(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"
