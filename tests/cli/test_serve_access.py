"""``llmd serve`` refusals that happen before any model loads: an unsafe ``--socket`` directory,
a lock file or socket of another user, a non-loopback ``--host`` without an API key. Each is
one ``llmd: error:`` line and exit 1, never a traceback (click's runner, in-process).

"Another user": as root, files are ``chown``-ed to uid 65534; otherwise ``os.geteuid`` is made
to answer another uid, so the same files look foreign."""

from __future__ import annotations

import os
import socket

import pytest
from click.testing import CliRunner
from serve_cli import dead_socket, live_socket, refused

from llmd.daemon.cli.main import main
from llmd.daemon.serving.lifecycle import claim_socket

KEY = "k3y-that-must-never-be-printed"


@pytest.fixture
def foreign(monkeypatch):
    """A function making a path look owned by another user."""
    def make(path):
        if os.geteuid() == 0:
            os.chown(path, 65534, 65534, follow_symlinks=False)
        else:
            monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    return make


def test_world_writable_socket_dir_is_refused_but_a_sticky_one_is_not(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    refused("--socket", str(d / "llmd.sock"), match="is writable by other users")
    assert not os.path.exists(d / "llmd.sock.lock")  # refused before anything is created there
    os.chmod(d, 0o1777)  # sticky, as /tmp: others cannot replace our files
    os.close(claim_socket(str(d / "llmd.sock")))


def test_a_second_daemon_on_a_socket_is_told_the_stop_command_for_that_socket(tmp_path):
    """The refusal names `llmd stop --socket PATH`: a bare `llmd stop` (what it said) stops the
    daemon on the default socket, not the one in the way."""
    path = str(tmp_path / "busy.sock")
    fd = claim_socket(path)  # a daemon holding the lock (running or still starting)
    try:
        refused("--socket", path, match=f"already running (or starting) on {path}; stop it with "
                                        f"`llmd stop --socket {path}`")
    finally:
        os.close(fd)
    with live_socket(path):  # something serving there without the lock
        refused("--socket", path, match=f"already serving on {path}; stop it with `llmd stop --socket {path}`")


def test_socket_dir_of_another_user_is_refused(tmp_path, foreign):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    foreign(d)
    refused("--socket", str(d / "llmd.sock"), match="belongs to another user")


def test_lock_file_of_another_user_or_a_symlink_is_refused(tmp_path, foreign):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)
    sock = d / "llmd.sock"
    (d / "llmd.sock.lock").write_text("")
    os.chmod(d / "llmd.sock.lock", 0o666)
    foreign(d / "llmd.sock.lock")
    refused("--socket", str(sock), match="lock file")
    os.unlink(d / "llmd.sock.lock")
    os.symlink(tmp_path / "elsewhere", d / "llmd.sock.lock")  # a planted symlink is never followed
    refused("--socket", str(sock), match="symlink")
    assert not os.path.exists(tmp_path / "elsewhere")


def test_stale_socket_of_another_user_is_refused(tmp_path, foreign):
    if os.geteuid() != 0:  # the directory and lock must stay ours: only the socket is foreign
        pytest.skip("a socket alone of another uid needs root to chown")
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    sock = str(d / "llmd.sock")
    dead_socket(sock)
    foreign(sock)
    refused("--socket", sock, match="the socket")


def test_non_loopback_host_needs_a_key_and_the_key_is_never_printed(tmp_path):
    sock = str(tmp_path / "llmd.sock")
    refused("--socket", sock, "--host", "0.0.0.0", "--port", "8000", env={"LLMD_API_KEY": ""},
            match="refusing to listen on 0.0.0.0:8000 without an API key")
    assert not os.path.exists(sock + ".lock")  # refused before the socket is claimed
    refused("--socket", sock, "--api-key", KEY, match="need --port")
    # --api-key is accepted with a warning; stop it right after (an unsafe directory) before a model loads
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    out = refused("--socket", str(d / "s.sock"), "--host", "0.0.0.0", "--port", "8000", "--api-key", KEY,
                  match="writable by other users")
    assert "/proc/PID/cmdline" in out and KEY not in out
    refused("--socket", sock, "--port", "8000", "--api-key-file", str(tmp_path / "nokey"),
            match="cannot read --api-key-file")


def test_stop_waits_for_a_daemon_that_is_already_draining(tmp_path):
    """A daemon at the end of its drain (listeners closed) no longer accepts, but holds its lock
    and socket file until it exits: `llmd stop` waits for that exit too (it said "no daemon
    running" at once, so `llmd stop && llmd serve` was refused as "already running"). A daemon
    still draining answers `/health` "draining": tests/e2e/test_daemon_drain.py."""
    import threading

    from llmd.daemon.protocol import lock_path, unlock_file

    path = str(tmp_path / "draining.sock")
    fd = claim_socket(path)
    closed = socket.socket(socket.AF_UNIX)  # bound, not listening: connections are refused
    closed.bind(path)

    def exit_daemon():
        closed.close()
        os.unlink(path)
        unlock_file(lock_path(path), fd)

    timer = threading.Timer(0.5, exit_daemon)
    timer.start()
    try:
        result = CliRunner().invoke(main, ["stop", "--socket", path, "--timeout", "10"])
    finally:
        timer.join()
    assert result.exit_code == 0, result.output
    assert "is already shutting down; waiting for it to exit" in result.output, result.output
    assert result.output.strip().splitlines()[-1] == "llmd: daemon stopped", result.output
    assert not os.path.exists(path) and not os.path.exists(lock_path(path))
    result = CliRunner().invoke(main, ["stop", "--socket", path])  # nothing there now: says so, exit 0
    assert result.exit_code == 0 and result.output.strip() == f"llmd: no daemon running on {path}", result.output
