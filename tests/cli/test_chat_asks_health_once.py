"""``llmd chat`` against a daemon that already serves asks its ``/health`` once at start: it
asked three times (``spawn.serving`` in the chat command, again in ``ensure_daemon``, and again
in ``check_running_daemon``). What it says to a daemon that loads or is unhealthy is unchanged.

A stub HTTP server on a Unix socket (stdlib ``http.server``, a thread of the test) stands in for
the daemon: it counts ``GET /health`` and answers ``/v1/chat/completions`` with one streamed word."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socketserver
import tempfile
import threading

import pytest
from click.testing import CliRunner

from llmd.daemon.cli.main import main


class StubDaemon(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Answers ``/health`` with ``states`` in turn (the last one repeated) and counts the asks."""

    daemon_threads = True

    def __init__(self, path: str, states: list[str]):
        self.states, self.health_asks = states, 0
        super().__init__(path, Handler)


class Handler(http.server.BaseHTTPRequestHandler):
    """``GET /health``: the stub's next state (200 for ``ok`` / ``draining``, else 503);
    ``POST /v1/chat/completions``: one SSE chunk "Paris", then ``[DONE]``."""

    def do_GET(self):
        srv = self.server
        if self.path != "/health":
            return self._json(404, {"error": {"message": "not found"}})
        state = srv.states[min(srv.health_asks, len(srv.states) - 1)]
        srv.health_asks += 1
        body = {"status": state, "pid": os.getpid(), "model": "stub", "model_ids": ["stub"], "uptime_s": 1.0}
        if state not in ("ok", "draining"):
            body["reason"] = "the engine thread died (stub)" if state == "dead" else "the model is loading"
        self._json(200 if state in ("ok", "draining") else 503, body)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        chunk = {"choices": [{"index": 0, "delta": {"content": "Paris"}, "finish_reason": "stop"}],
                 "usage": {"completion_tokens": 1}}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # quiet (and a Unix peer has no address to print)
        pass


@pytest.fixture
def stub():
    """A function starting a :class:`StubDaemon` on a short socket path; stopped afterwards."""
    tmp = tempfile.mkdtemp(prefix="llmd", dir="/tmp")
    servers = []

    def start(*states: str) -> StubDaemon:
        srv = StubDaemon(os.path.join(tmp, "d.sock"), list(states))
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()
    shutil.rmtree(tmp, ignore_errors=True)


def chat(srv: StubDaemon, *args: str):
    log = os.path.join(os.path.dirname(srv.server_address), "daemon.log")
    return CliRunner().invoke(main, ["chat", "--socket", srv.server_address, "--daemon-log", log, "-p", "hi", *args])


def test_chat_asks_a_serving_daemon_for_its_health_once(stub):
    srv = stub("ok")
    result = chat(srv)
    assert result.exit_code == 0 and "Paris" in result.output, result.output
    assert srv.health_asks == 1


def test_the_one_answer_also_checks_the_model_asked_for(stub):
    """``--model`` of another name is refused by that same answer's ``model_ids``, and another
    engine option gets its note."""
    srv = stub("ok")
    result = chat(srv, "--model", "other")
    assert result.exit_code == 1, result.output
    assert f"llmd: error: the daemon on {srv.server_address} serves 'stub', not 'other'" in result.output
    assert srv.health_asks == 1
    srv.states, srv.health_asks = ["ok"], 0
    result = chat(srv, "--model", "stub", "--kv-cache-dtype", "int8")
    assert result.exit_code == 0 and "--kv-cache-dtype applies only when `llmd chat` starts one" in result.output
    assert srv.health_asks == 1


def test_a_loading_daemon_is_waited_for_then_checked(stub):
    srv = stub(*["loading"] * 8, "ok")  # enough for the asks before ensure_daemon's wait, old and new
    result = chat(srv, "--model", "other")
    assert result.exit_code == 1 and "serves 'stub', not 'other'" in result.output, result.output
    assert "daemon ready after" in result.output, result.output


def test_an_unhealthy_daemon_is_still_reported(stub):
    srv = stub("dead")
    result = chat(srv, "--model", "random:qwen3-0.6b")  # a random preset: no chat template to read
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"llmd: error: the daemon on {srv.server_address} is unhealthy (the engine thread died (stub)); "
        f"see {os.path.join(os.path.dirname(srv.server_address), 'daemon.log')}"), result.output
