"""The real daemon's TCP listener (``llmd serve --host 127.0.0.1 --port P`` with ``$LLMD_API_KEY``;
the session's main daemon of ``tests/fixtures/daemon_harness.py``) beside its Unix socket:
the key guards the API but not ``/health`` and ``/metrics``, foreign ``Host``/``Origin`` are
403, non-JSON bodies 415, while the socket takes the README's curl requests as they are. The
key never reaches the log or the command line. Never sends the key to ``/v1/shutdown``: the
daemon is shared by the session."""

from __future__ import annotations

import http.client
import json
import socket

BODY = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket (what ``curl --unix-socket`` does)."""

    def __init__(self, path: str):
        super().__init__("llmd", timeout=120)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def call(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None, **headers):
    """(status, decoded JSON or text, headers) of one request on a fresh connection."""
    try:
        conn.request(method, path, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()})
        resp = conn.getresponse()
        raw = resp.read().decode()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            data = raw
        return resp.status, data, resp.headers
    finally:
        conn.close()


def test_tcp_needs_the_key_json_and_loopback_headers_but_the_socket_does_not(llmd_daemon):
    d = llmd_daemon
    tcp = lambda: http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)  # noqa: E731
    auth = f"Bearer {d.api_key}"
    assert call(tcp(), "GET", "/health")[0] == 200
    status, text, _ = call(tcp(), "GET", "/metrics")
    assert status == 200 and "llmd:num_requests_running" in text
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": d.api_key}):
        status, body, hdrs = call(tcp(), "GET", "/v1/models", **headers)
        assert status == 401 and body["error"]["code"] == 401 and hdrs["WWW-Authenticate"] == "Bearer", body
    assert call(tcp(), "GET", "/v1/models", Authorization=auth)[0] == 200
    assert call(tcp(), "POST", "/v1/shutdown", b"{}", Content_Type="application/json")[0] == 401
    assert call(tcp(), "GET", "/v1/stats")[0] == 401

    status, body, _ = call(tcp(), "POST", "/v1/completions", BODY, Authorization=auth, Content_Type="text/plain")
    assert status == 415 and "application/json" in body["error"]["message"], body
    status, over_tcp, _ = call(tcp(), "POST", "/v1/completions", BODY, Authorization=auth,
                               Content_Type="application/json", Host=f"localhost:{d.port}")
    assert status == 200, over_tcp
    status, body, _ = call(tcp(), "GET", "/health", Host="attacker.example")  # DNS rebinding
    assert status == 403 and "loopback" in body["error"]["message"]
    status, body, _ = call(tcp(), "POST", "/v1/completions", BODY, Authorization=auth,
                           Content_Type="application/json", Origin="http://attacker.example")
    assert status == 403, body

    # the Unix socket: no key, and curl -d's form content type, as the README's examples send
    status, over_socket, _ = call(UnixHTTPConnection(d.path), "POST", "/v1/completions", BODY,
                                  Content_Type="application/x-www-form-urlencoded")
    assert status == 200 and over_socket["choices"][0]["text"] == over_tcp["choices"][0]["text"], over_socket
    # fcfs (the default policy): a priority is a 400 naming it
    status, body, _ = call(UnixHTTPConnection(d.path), "POST", "/v1/completions",
                           json.dumps({"prompt": "hi", "max_tokens": 2, "priority": 1}).encode())
    assert status == 400 and body["error"]["param"] == "priority", body

    assert d.client().health()["status"] == "ok"
    with open(f"/proc/{d.pid}/cmdline", "rb") as f:
        assert d.api_key.encode() not in f.read()
    log = d.log_text()
    assert f"http://127.0.0.1:{d.port} (API key required)" in log and d.api_key not in log
