"""``llmd serve`` refusals of its TCP listener and P/D flags, before any model loads: a ``--port``
out of range (click), a port that cannot be bound (one line naming host:port and the OS's reason,
no ``<socket>`` or ``<socket>.lock`` left; it was an asyncio OSError traceback), and a P/D flag
the ``--kv-role`` would ignore (it started and did nothing with it)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from serve_cli import one_error_line, refused, serve

from llmd.daemon.core.errors import LlmdError


@pytest.fixture
def busy_port():
    """A loopback port something else listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def test_a_port_in_use_is_one_line_before_the_socket_is_claimed(tmp_path, busy_port):
    sock = str(tmp_path / "e.sock")
    out = refused("--socket", sock, "--port", str(busy_port),
                  match=f"cannot listen on 127.0.0.1:{busy_port}: address already in use")
    assert "loading" not in out and os.listdir(tmp_path) == []  # no socket, no lock file


def test_a_port_out_of_range_is_a_usage_error(tmp_path):
    for port in ("99999", "0", "-1"):
        code, out = serve("--socket", str(tmp_path / "c.sock"), "--port", port, env={"LLMD_API_KEY": "x"})
        assert code == 2
        one_error_line(out, "--port")
        assert "1<=x<=65535" in out and "loading" not in out and os.listdir(tmp_path) == []


def test_a_port_taken_after_the_check_is_one_line_and_cleans_up(tmp_path, busy_port, monkeypatch):
    """The port is taken between the early check and the real bind (here: the check skipped):
    the bind's OSError is the same one line, the engine never starts loading, and the socket
    and lock file are removed."""
    import llmd.daemon.serving.access as access

    monkeypatch.setattr(access, "check_listen", lambda host, port: None)
    out = refused("--socket", str(tmp_path / "e.sock"), "--port", str(busy_port),
                  match=f"cannot listen on 127.0.0.1:{busy_port}: address already in use")
    assert "loading" not in out and os.listdir(tmp_path) == []


def test_run_server_on_a_busy_port_raises_before_building_the_engine(tmp_path, busy_port):
    from llmd.daemon.serving.lifecycle import run_server

    built = []
    sock = str(tmp_path / "d.sock")
    with pytest.raises(LlmdError, match=f"cannot listen on 127.0.0.1:{busy_port}: address already in use"):
        asyncio.run(run_server(lambda: built.append(1), sock, "x", ("x",), port=busy_port, echo=lambda m: None))
    assert built == [] and os.listdir(tmp_path) == []


def test_an_address_not_of_this_machine_is_one_line(tmp_path):
    refused("--socket", str(tmp_path / "c.sock"), "--host", "192.0.2.1", "--port", "18124",  # TEST-NET-1: never local
            env={"LLMD_API_KEY": "x"}, match="cannot listen on 192.0.2.1:18124: cannot assign requested address")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("role, args, match", [
    ("both", ["--kv-producer", "127.0.0.1:8100"], "--kv-producer is for --kv-role consumer only"),
    ("both", ["--kv-pull-timeout", "5"], "--kv-pull-timeout is for --kv-role consumer only"),
    ("both", ["--kv-advertise-host", "10.0.0.1", "--kv-pull-timeout", "5"],
     "--kv-advertise-host is for --kv-role producer only"),
    ("both", ["--kv-pin-timeout", "60"], "--kv-pin-timeout is for --kv-role producer only"),  # the default, given
    ("producer", ["--port", "18124", "--kv-producer", "127.0.0.1:8100"], "--kv-producer is for --kv-role consumer"),
    ("producer", ["--port", "18124", "--kv-pull-timeout", "5"], "--kv-pull-timeout is for --kv-role consumer"),
    ("consumer", ["--kv-advertise-host", "10.0.0.1"], "--kv-advertise-host is for --kv-role producer"),
    ("consumer", ["--kv-pin-timeout", "5"], "--kv-pin-timeout is for --kv-role producer only (this daemon is "
                                            "--kv-role consumer"),
])
def test_a_pd_flag_the_role_ignores_is_refused_before_anything(tmp_path, role, args, match):
    out = refused("--socket", str(tmp_path / "c.sock"), "--kv-role", role, *args, match=match)
    assert "loading" not in out and os.listdir(tmp_path) == []


def test_pd_flags_of_the_role_pass_on_to_the_model_error(tmp_path):
    """The matching role accepts its flags: the start goes on to the (missing) model."""
    refused("--socket", str(tmp_path / "c.sock"), "--kv-role", "consumer", "--kv-pull-timeout", "5",
            "--kv-producer", "127.0.0.1:8100", match="model file not found")
