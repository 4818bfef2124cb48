"""Prefill/decode disaggregation between two real daemon processes (issue 21): tiny random-GGUF
daemons (``tests/fixtures/tiny_daemon.py``, the same ``run_server`` as ``llmd serve``) with
``--kv-role producer`` and ``--kv-role consumer`` on loopback TCP behind one API key. The
router's handshake gives the single daemon's tokens with one prompt token computed; then the
producer is killed (SIGKILL) between the two legs: the consumer's pull is refused, it computes
the prefill itself, answers the same, and keeps no block."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import urllib.request

import tiny_daemon
from kv_pair import ROUTER_PREFILL

from llmd.daemon.bench.routing import free_port
from llmd.daemon.client.client import Client

KEY = "llmd-kv-e2e-" + os.urandom(8).hex()


def _post(port: int, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body or {}).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                                 method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _start(role: str, root: str) -> tuple:
    d = tempfile.mkdtemp(prefix=role[:4], dir=root)
    port = free_port()
    env = dict(os.environ, TINY_DAEMON_PORT=str(port), TINY_DAEMON_KV_ROLE=role, LLMD_API_KEY=KEY,
               LLMD_DEBUG_ROUTES="1", LLMD_FAULT_INJECT="")
    proc = tiny_daemon.start(os.path.join(d, "s.sock"), os.path.join(d, "tiny.gguf"), os.path.join(d, "log"), env=env)
    return proc, port, os.path.join(d, "s.sock"), os.path.join(d, "log")


def _wait(sock: str, log: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(sock) and Client(sock, timeout=2).health() is not None:
            return
        time.sleep(0.2)
    raise AssertionError(open(log).read()[-2000:])


def test_two_daemons_handshake_and_a_producer_killed_mid_handshake():
    root = tempfile.mkdtemp(prefix="llmdkv", dir="/tmp")
    (prod, pport, psock, plog), (cons, cport, csock, clog) = _start("producer", root), _start("consumer", root)
    try:
        _wait(psock, plog), _wait(csock, clog)
        prompts = ["the first prompt of this test, long enough for four blocks: abcdefghij",
                   "a second prompt, after which the producer dies before it is pulled"]
        bodies = [{"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts]
        refs = [_post(cport, "/v1/completions", b)["choices"][0]["text"] for b in bodies]
        _post(cport, "/v1/cache/reset", {})
        before = _post(cport, "/v1/stats")["counters"]["prompt_tokens"]
        pre = _post(pport, "/v1/completions", {**bodies[0], **ROUTER_PREFILL})
        out = _post(cport, "/v1/completions", {**bodies[0], "kv_transfer_params": pre["kv_transfer_params"]})
        stats = _post(cport, "/v1/stats")
        assert out["choices"][0]["text"] == refs[0]
        assert stats["counters"]["prompt_tokens"] - before == 1 and stats["kv_transfer"]["imported"] == 1
        assert _post(pport, "/v1/stats")["kv_transfer"]["pins_live"] == 0

        pre = _post(pport, "/v1/completions", {**bodies[1], **ROUTER_PREFILL})
        prod.send_signal(signal.SIGKILL)
        prod.wait(30)
        out = _post(cport, "/v1/completions", {**bodies[1], "kv_transfer_params": pre["kv_transfer_params"]})
        assert out["choices"][0]["text"] == refs[1]
        stats = _post(cport, "/v1/stats")
        assert stats["kv_transfer"]["recomputed_pull_failed"] == 1
        report = _post(cport, "/v1/debug/integrity")
        assert report["ok"] and report["live"]["used_blocks"] == 0 and report["live"]["kv_tables"] == 0
    finally:
        for p in (prod, cons):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (prod, cons):
            p.wait(30)
