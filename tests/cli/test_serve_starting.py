"""A daemon between taking its lock and binding its socket (``llmd serve`` imports torch and
checks its options there, ~2 s): ``llmd status`` names it as starting (it said "no llmd daemon"),
and ``llmd stop`` ends it (SIGTERM) and waits for it to exit. The lock file holds the daemon's
pid (:func:`llmd.daemon.serving.socket_claim.claim_socket`). A subprocess that takes the lock and
sleeps stands in for the starting daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner
from serve_cli import lock_holder

from llmd.daemon.cli.main import main
from llmd.daemon.client import spawn
from llmd.daemon.client.client import Client, DaemonStarting, DaemonUnavailable
from llmd.daemon.client.spawn import starting_pid
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.serving.socket_claim import claim_socket


def test_claim_writes_the_pid_and_a_client_reads_it(tmp_path):
    path = str(tmp_path / "d.sock")
    assert starting_pid(path) is None  # no lock
    fd = claim_socket(path)
    try:
        assert open(path + ".lock").read() == f"{os.getpid()}\n"
        assert starting_pid(path) == os.getpid()  # held (another open file description) and no socket
        open(path, "w").close()  # a socket file is there: not "starting" any more
        assert starting_pid(path) is None
    finally:
        os.close(fd)
    os.unlink(path)
    assert starting_pid(path) is None  # released


def test_status_and_stop_see_a_starting_daemon(tmp_path):
    path = str(tmp_path / "d.sock")
    with lock_holder(path) as holder:
        reaper = threading.Thread(target=holder.wait)  # reaped at once, so its pid is gone when it exits
        status = CliRunner().invoke(main, ["status", "--socket", path])
        assert status.exit_code == 0 and f"(pid {holder.pid}), starting: its socket is not up yet" in status.output, \
            status.output
        reaper.start()
        t0 = time.monotonic()
        stop = CliRunner().invoke(main, ["stop", "--socket", path, "--timeout", "20"])
        assert stop.exit_code == 0, stop.output
        assert f"(pid {holder.pid}), which was still starting" in stop.output and "daemon stopped" in stop.output
        assert time.monotonic() - t0 < 10
        reaper.join(5)
        assert holder.returncode == -15  # SIGTERM


def test_ps_and_the_client_see_a_starting_daemon(tmp_path):
    """`llmd ps` (any command that connects: the client's error) names the starting daemon and
    says to try again, where it said "no llmd daemon ...; start one with `llmd serve`"."""
    path = str(tmp_path / "d.sock")
    with lock_holder(path) as holder:
        ps = CliRunner().invoke(main, ["ps", "--socket", path])
        assert ps.exit_code == 1 and "start one" not in ps.output, ps.output
        assert ps.output.splitlines() == [f"llmd: error: the llmd daemon on {path} (pid {holder.pid}) is starting: "
                                          "its socket is not up yet; try again in a moment"], ps.output
        with pytest.raises(DaemonStarting) as e:
            Client(path).stats()
        assert e.value.pid == holder.pid and isinstance(e.value, DaemonUnavailable)  # callers that retry still do
        assert Client(path).health(ready_only=False) is None
    ps = CliRunner().invoke(main, ["ps", "--socket", path])  # gone: the usual line
    assert ps.exit_code == 1 and f"no llmd daemon on {path} (No such file or directory); start one" in ps.output


def test_starting_pid_probes_the_lock_only_once_it_names_a_live_process(tmp_path, monkeypatch):
    """A failed connection asks whether a daemon is starting; the probe takes the lock for a
    moment, so it must not run while a daemon may be taking it (before it writes its pid), or
    that daemon would be refused as "another llmd daemon is already running"."""
    path = str(tmp_path / "d.sock")
    probes = []
    monkeypatch.setattr(spawn, "lock_held", lambda p: probes.append(p) or True)
    assert starting_pid(path) is None  # no lock file
    open(path + ".lock", "w").close()  # created, its pid not written yet
    assert starting_pid(path) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(path + ".lock", "w") as f:
        f.write(f"{dead.pid}\n")  # a crashed daemon's file
    assert starting_pid(path) is None and probes == []
    with open(path + ".lock", "w") as f:
        f.write(f"{os.getpid()}\n")
    assert starting_pid(path) == os.getpid() and probes == [path + ".lock"]


def test_serve_takes_the_lock_before_importing_torch_and_drops_it_on_a_bad_option(tmp_path):
    """A real `llmd serve` subprocess: its lock file (with its pid) exists before torch is imported;
    a bad option (here --block-size 0, found after the import) exits 1 with one line and leaves no
    lock file."""
    path = str(tmp_path / "d.sock")
    code = ("import sys, runpy\nfrom llmd.daemon.serving import socket_claim\n"
            "orig = socket_claim.claim_socket\n"
            "def claim(p):\n    fd = orig(p)\n    print('torch imported:', 'torch' in sys.modules, flush=True)\n"
            "    return fd\n"
            "socket_claim.claim_socket = claim\n"
            "from llmd.daemon.cli.main import main\nmain()\n")
    res = subprocess.run([sys.executable, "-c", code, "serve", "--socket", path, "--model", "random:qwen3-0.6b",
                          "--block-size", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "torch imported: False" in res.stdout, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines() == ["llmd: error: --block-size must be >= 1, got 0"], res.stderr
    assert not os.path.exists(path + ".lock") and not os.path.exists(path)


def test_a_signal_between_the_checks_and_the_servers_handlers_drains_and_leaves_no_lock(tmp_path):
    """SIGTERM after ``serve``'s checks (here from inside ``setproctitle``, which runs in that
    window) used to raise SystemExit where nothing removed ``<socket>.lock`` (exit 143, lock file
    left). It is now kept until ``run_server``'s handlers are in place, which drain at once."""
    path = str(tmp_path / "d.sock")
    code = ("import os, signal, setproctitle\n"
            "setproctitle.setproctitle = lambda title: os.kill(os.getpid(), signal.SIGTERM)\n"
            "from llmd.daemon.cli.main import main\nmain()\n")
    res = subprocess.run([sys.executable, "-c", code, "serve", "--socket", path,
                          "--model", "random:qwen3-0.6b:layers=1"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stderr.strip().endswith("llmd: stopped"), (res.returncode, res.stderr)
    assert not os.path.exists(path + ".lock") and not os.path.exists(path)


def test_chat_waits_for_a_starting_daemon_instead_of_starting_another(tmp_path, monkeypatch):
    """``ensure_daemon`` (``llmd chat``) on a path whose daemon is still starting used to spawn a
    second daemon (which failed to take the lock) and say "starting a daemon (pid X)". It now says
    it waits for the starting one, spawns nothing, and, if that one exits without serving, says so
    at once instead of waiting out its timeout."""
    path = str(tmp_path / "d.sock")
    with lock_holder(path) as holder:

        def no_spawn(*a, **k):
            raise AssertionError("a second daemon was spawned")

        monkeypatch.setattr(spawn.subprocess, "Popen", no_spawn)
        threading.Timer(1.0, holder.kill).start()  # the starting daemon dies before it serves
        events = []
        t0 = time.monotonic()
        with pytest.raises(LlmdError, match=rf"\(pid {holder.pid}\) exited before it served"):
            spawn.ensure_daemon(path, [], str(tmp_path / "d.log"), timeout=30,
                                echo=lambda m, nl=True: events.append(m))
        assert time.monotonic() - t0 < 10
        assert events[0] == f"llmd: the daemon on {path} (pid {holder.pid}) is starting; waiting for it", events


def test_chat_checks_its_options_against_a_daemon_that_was_starting(tmp_path, monkeypatch):
    """``llmd chat --model B`` while a daemon (of model A, say) is still starting waits for that
    daemon, so it must then check its options against it, as against one that served already
    (``spawn.check_running_daemon``: a model it does not serve is refused); it chatted on silently."""
    path = str(tmp_path / "d.sock")
    with lock_holder(path):
        monkeypatch.setattr(spawn, "ensure_daemon", lambda *a, **k: Client(path))  # as once it serves

        def checked(client, model, ignored, **kw):
            raise LlmdError(f"checked against the running daemon: model {model}")

        monkeypatch.setattr(spawn, "check_running_daemon", checked)
        result = CliRunner().invoke(main, ["chat", "--socket", path, "--model", "other-model", "-p", "hi"])
        assert "checked against the running daemon: model other-model" in result.output, result.output
