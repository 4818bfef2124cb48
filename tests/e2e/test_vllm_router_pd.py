"""The real ``vllm-router`` (0.1.17, ``--vllm-pd-disaggregation``) driving llmd's prefill/decode
disaggregation: a producer and a consumer worker in-process (``kv_pair``'s apps on aiohttp's
loopback ``TestServer``, tiny engines with the same weights), the router a subprocess in front.

The router sends the prefill leg (``max_tokens: 1``, ``kv_transfer_params.do_remote_decode``) to
the producer and the original request with the producer's params to the consumer, which pulls
the KV over TCP: the routed reply equals the consumer's own, the consumer imported the prompt
and computed one prompt token, and both pools end empty. vllm-router 0.1.17 forwards the
generation legs with an empty ``Authorization: Bearer`` in PD mode (its own key goes only to
``/tokenize`` and the renders; recorded here), so these workers run without a key, on loopback
(which llmd allows). Skipped when the router is not installed (``pip install -e '.[cluster]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from app_harness import start_loop, state_of
from kv_pair import audit

from llmd.daemon.bench.routing import find_router, free_ports, stop, wait_healthy
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.serving.access import AccessPolicy, access_middleware
from llmd.daemon.serving.api import make_app
from llmd.daemon.serving.kv_transfer.config import KVTransferConfig


@pytest.fixture(scope="module")
def router():
    try:
        return find_router()
    except LlmdError:
        pytest.skip("vllm-router is not installed (pip install -e '.[cluster]')")


def _recording(log: list):
    @web.middleware
    async def middleware(request, handler):
        body = await request.json() if request.method == "POST" and request.body_exists else None
        log.append((request.path, request.headers.get("Authorization"), body))
        return await handler(request)

    return middleware


@contextlib.asynccontextmanager
async def _workers(loops, logs):
    states = [state_of(lp) for lp in loops]
    states[0].kv_transfer = KVTransferConfig("producer", "127.0.0.1", 1, None).check()
    states[1].kv_transfer = KVTransferConfig("consumer").check()
    guard = access_middleware(AccessPolicy(None, loopback=True))
    apps = [make_app(st, guard) for st in states]
    for app, log in zip(apps, logs):
        app.middlewares.insert(0, _recording(log))
    async with TestClient(TestServer(apps[0])) as p, TestClient(TestServer(apps[1])) as c:
        states[0].kv_transfer.port = p.server.port
        yield p, c


def test_vllm_router_pd_mode_drives_the_handshake(router, tmp_path_factory, tmp_path):
    loops = [start_loop(tmp_path_factory, max_num_seqs=4) for _ in range(2)]
    logs: list[list] = [[], []]
    body = {"model": "tiny", "prompt": "routed through the prefill worker, decoded on the other: 0123456789",
            "max_tokens": 8, "temperature": 0}

    async def main():
        async with _workers(loops, logs) as (p, c):
            direct = await (await c.post("/v1/completions", json=body)).json()
            await c.post("/v1/cache/reset", json={})
            (port, metrics_port), log = free_ports(2), str(tmp_path / "router.log")
            with open(log, "wb") as f:
                proc = subprocess.Popen(
                    [router, "--vllm-pd-disaggregation", "--prefill", str(p.make_url("")).rstrip("/"), "--decode",
                     str(c.make_url("")).rstrip("/"), "--host", "127.0.0.1", "--port", str(port), "--api-key",
                     "router-key", "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
                     "--log-level", os.environ.get("LLMD_ROUTER_LOG_LEVEL", "warning")],
                    stdout=f, stderr=f, stdin=subprocess.DEVNULL)
            try:
                url = f"http://127.0.0.1:{port}"
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                    await wait_healthy(s, url, proc, log, 60)
                    for lg in logs:
                        lg.clear()
                    before = (await audit(c))["counters"]["prompt_tokens"]
                    async with s.post(url + "/v1/completions", json=body,
                                      headers={"Authorization": "Bearer router-key"}) as r:
                        assert r.status == 200, await r.text()
                        routed = await r.json()
            finally:
                stop(proc, 10)
            cstats, _ = await audit(c), await audit(p)
            return direct, routed, cstats, before

    try:
        direct, routed, cstats, before = asyncio.run(main())
    finally:
        for lp in loops:
            lp.stop()
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    assert cstats["kv_transfer"]["imported"] == 1 and cstats["counters"]["prompt_tokens"] - before == 1
    prefill = [b for path, _, b in logs[0] if path == "/v1/completions"]
    decode = [(auth, b) for path, auth, b in logs[1] if path == "/v1/completions"]
    assert len(prefill) == 1 and prefill[0]["max_tokens"] == 1 and prefill[0]["kv_transfer_params"]["do_remote_decode"]
    assert len(decode) == 1 and decode[0][1]["kv_transfer_params"]["do_remote_prefill"]
    assert decode[0][0] == "Bearer"  # what 0.1.17 forwards on the generation legs: the scheme, no key
