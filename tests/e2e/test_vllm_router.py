"""The real ``vllm-router`` binary (the ``llmd[cluster]`` extra, 0.1.17) in front of two llmd
workers on loopback TCP with an API key: two routers at once, ``round_robin`` and
``cache_aware``, each a subprocess; the workers are the HTTP app in-process (``make_app`` with
the TCP access middleware, aiohttp's ``TCPSite``) over two tiny random-GGUF engines with the
same weights, so a reply does not depend on the worker. A recording middleware in front of the
access check logs what each worker receives.

Shown: the router's health checks reach ``/health`` without a key and get 200; requests reach
both workers (round robin alternates), with the client's ``Authorization`` forwarded, and their
replies (completions, chat, a chat stream) equal the same request sent to a worker directly,
the router's added fields included; cache-aware routing renders every request on the workers
with the router's own key through ``/v1/completions/render`` (never falling back to
``/tokenize``: the render answered), spreads two prompts by load (the second is routed while
the first generates) and, with equal loads, sends each prompt again to the worker that served
it (with no prefix match, equal loads would send both to the first worker).
Skipped only when the router is not installed (``pip install -e '.[cluster]'``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web
from app_harness import start_loop, state_of
from daemon_harness import free_port

from llmd.daemon.serving.access import AccessPolicy, access_middleware
from llmd.daemon.serving.api import make_app

KEY = "router-test-" + os.urandom(8).hex()
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTER = shutil.which("vllm-router") or shutil.which("vllm-router", path=os.path.dirname(sys.executable))


@pytest.fixture(scope="module")
def engine_loops(tmp_path_factory):
    if ROUTER is None:
        pytest.skip("vllm-router is not installed (pip install -e '.[cluster]')")
    loops = [start_loop(tmp_path_factory, max_num_seqs=4) for _ in range(2)]
    yield loops
    for loop in loops:
        loop.stop()


def recording(log: list, inner):
    """A middleware appending (method, path, Authorization or None, the body's ``prompt`` or
    None) to ``log``, then ``inner``."""

    @web.middleware
    async def middleware(request, handler):
        body = await request.json() if request.method == "POST" and request.body_exists else None
        prompt = body.get("prompt") if isinstance(body, dict) else None
        log.append((request.method, request.path, request.headers.get("Authorization"), prompt))
        return await inner(request, handler)

    return middleware


async def start_worker(engine_loop, log: list) -> tuple[web.AppRunner, str]:
    """One worker as ``llmd serve --host 127.0.0.1 --port P`` with a key serves it; its base URL."""
    app = make_app(state_of(engine_loop), recording(log, access_middleware(AccessPolicy(KEY, loopback=True))))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def start_router(urls: list[str], policy: str, log_path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--api-key", KEY, "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
            "--log-level", "warning"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log_path).read()[-2000:]
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"the router at {url} did not answer /health: {open(log_path).read()[-2000:]}")


def served(log: list) -> list[str]:
    """The generation requests a worker's log holds (renders and tokenizations left out)."""
    return [path for method, path, _, _ in log if path in ("/v1/completions", "/v1/chat/completions")]


def test_vllm_router_in_front_of_two_llmd_workers(engine_loops, tmp_path):
    logs: list[list] = [[], []]
    completion = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hello router"}], "max_tokens": 6, "temperature": 0}

    async def main():
        workers = [await start_worker(loop, log) for loop, log in zip(engine_loops, logs)]
        urls = [u for _, u in workers]
        rr, rr_url = start_router(urls, "round_robin", tmp_path / "rr.log")
        ca, ca_url = start_router(urls, "cache_aware", tmp_path / "ca.log")
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                direct = {}
                for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                    async with s.post(urls[0] + path, json=body, headers=AUTH) as r:
                        direct[path] = (await r.json())["choices"][0]
                await wait_ready(s, rr_url, rr, tmp_path / "rr.log")
                await wait_ready(s, ca_url, ca, tmp_path / "ca.log")
                probes = [entry for log in logs for entry in log if entry[1] == "/health"]
                for log in logs:
                    log.clear()
                routed = []
                for path, body in (("/v1/completions", completion), ("/v1/completions", completion),
                                   ("/v1/chat/completions", chat), ("/v1/chat/completions", chat)):
                    async with s.post(rr_url + path, json=body, headers=AUTH) as r:
                        assert r.status == 200, await r.text()
                        routed.append((path, (await r.json())["choices"][0]))
                async with s.post(rr_url + "/v1/chat/completions", json={**chat, "stream": True}, headers=AUTH) as r:
                    stream = (await r.read()).decode()
                rr_logs = [list(log) for log in logs]
                for log in logs:
                    log.clear()
                prompts = [f"{word} " * 40 for word in ("alpha", "zebra")]  # 240 tokens each

                async def complete(p, max_tokens=2):
                    async with s.post(ca_url + "/v1/completions", json={"prompt": p, "max_tokens": max_tokens},
                                      headers=AUTH) as r:
                        assert r.status == 200, await r.text()

                # the first prompt still generating when the second is routed: least load spreads them
                first = asyncio.create_task(complete(prompts[0], 200))
                while not any(served(log) for log in logs):
                    await asyncio.sleep(0.01)
                await complete(prompts[1])
                await first
                for p in prompts:  # then one at a time (equal loads): each goes where its prefix is
                    await complete(p)
                ca_logs = [list(log) for log in logs]
        finally:
            for proc in (rr, ca):
                proc.terminate()
                proc.wait(10)
            for runner, _ in workers:
                await runner.cleanup()
        return probes, direct, routed, stream, rr_logs, ca_logs

    probes, direct, routed, stream, rr_logs, ca_logs = asyncio.run(main())
    assert probes and all(auth is None for _, _, auth, _ in probes)  # the router's health checks: no key
    for path, choice in routed:
        assert choice == direct[path]
    text = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
                   for line in stream.splitlines() if line.startswith("data: {"))
    assert stream.rstrip().endswith("data: [DONE]") and text == direct["/v1/chat/completions"]["message"]["content"]
    # round robin: both workers served, every request carrying the client's key
    assert sorted(served(rr_logs[0]) + served(rr_logs[1])) == ["/v1/chat/completions"] * 3 + ["/v1/completions"] * 2
    assert served(rr_logs[0]) and served(rr_logs[1])
    assert all(auth == AUTH["Authorization"] for log in rr_logs for m, _, auth, _ in log if m == "POST")
    # cache aware: every request rendered on every worker with the router's key (the render
    # answered: no /tokenize fallback), and each prompt served twice by one worker
    for log in ca_logs:
        renders = [auth for _, path, auth, _ in log if path == "/v1/completions/render"]
        assert renders == [AUTH["Authorization"]] * 4, log
        assert not [path for _, path, _, _ in log if path == "/tokenize"], log
    where = {}
    for i, log in enumerate(ca_logs):
        for _, path, _, prompt in log:
            if path == "/v1/completions":
                where.setdefault(prompt, []).append(i)
    assert sorted(where.values()) == [[0, 0], [1, 1]], where

