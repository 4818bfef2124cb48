"""A ``llmd serve`` refused after taking ``<socket>.lock`` (the path is a regular file, a socket of
another user, or a live socket without a lock) removes the lock file it created: it used to leave
an empty ``<socket>.lock`` behind. A lock held by another process, or a lock file of another user,
is theirs and stays (click's runner, in-process; no model loads)."""

from __future__ import annotations

import os
import signal

import pytest
from serve_cli import dead_socket, live_socket, lock_holder, refused, serve


def test_a_regular_file_on_the_path_leaves_no_lock_file(tmp_path):
    path = tmp_path / "a.sock"
    path.touch()
    refused("--socket", str(path), match=f"{path} exists and is not a socket")
    assert sorted(os.listdir(tmp_path)) == ["a.sock"]


def test_a_live_socket_without_a_lock_leaves_no_lock_file(tmp_path):
    path = str(tmp_path / "live.sock")
    with live_socket(path):
        refused("--socket", path, match=f"already serving on {path}")
        assert sorted(os.listdir(tmp_path)) == ["live.sock"]


def test_a_socket_of_another_user_leaves_no_lock_file(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a socket of another uid needs root to chown")
    path = str(tmp_path / "theirs.sock")
    dead_socket(path)
    os.chown(path, 65534, 65534)
    refused("--socket", path, match=f"the socket {path} belongs to another user")
    assert sorted(os.listdir(tmp_path)) == ["theirs.sock"]


def test_a_lock_held_by_another_process_stays(tmp_path):
    path = str(tmp_path / "busy.sock")
    with lock_holder(path) as holder:
        refused("--socket", path, match="already running (or starting)")
        assert open(path + ".lock").read() == f"{holder.pid}\n"  # the holder's file, untouched


def test_a_refused_claim_restores_the_callers_sigterm_handler(tmp_path):
    """``serve`` sets its startup SIGTERM handler before claiming the socket; a refused claim
    (here: the path is a regular file) puts the caller's handler back, as a later refusal does."""
    path = tmp_path / "a.sock"
    path.write_text("")
    before = signal.getsignal(signal.SIGTERM)
    code, out = serve("--socket", str(path))
    assert code == 1 and "is not a socket" in out, out
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_failed_listen_after_the_checks_restores_the_callers_signal_handlers(tmp_path, monkeypatch):
    """After its checks ``serve`` keeps SIGTERM / SIGINT for ``run_server``; when ``run_server``
    fails before its own handlers take over (a listener that cannot be bound), the caller's
    handlers come back (they stayed the deferral: an in-process caller's Ctrl-C was swallowed),
    and the lock and socket are gone."""
    from llmd.daemon.core.errors import LlmdError
    from llmd.daemon.serving import lifecycle

    async def refuse(*a, **k):
        raise LlmdError("cannot listen (test)")

    monkeypatch.setattr(lifecycle, "_listen", refuse)
    path = tmp_path / "a.sock"
    term, intr = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    code, out = serve("--socket", str(path), "--model", "random:qwen3-0.6b:layers=1")
    assert code == 1 and "cannot listen (test)" in out, out
    assert signal.getsignal(signal.SIGTERM) is term and signal.getsignal(signal.SIGINT) is intr
    assert not os.path.exists(str(path) + ".lock") and not path.exists()
