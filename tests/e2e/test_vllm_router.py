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

import aiohttp
import pytest
from app_harness import start_loop
from router_workers import start_worker

from llmd.daemon.bench.routing import find_router, start_router, stop, wait_healthy
from llmd.daemon.core.errors import LlmdError

KEY = "router-test-" + os.urandom(8).hex()
AUTH = {"Authorization": f"Bearer {KEY}"}


def router_or_skip() -> str:
    try:
        return find_router()
    except LlmdError:
        pytest.skip("vllm-router is not installed (pip install -e '.[cluster]')")


@pytest.fixture(scope="module")
def engine_loops(tmp_path_factory):
    router_or_skip()
    loops = [start_loop(tmp_path_factory, max_num_seqs=4) for _ in range(2)]
    yield loops
    for loop in loops:
        loop.stop()


def served(log: list) -> list[str]:
    """The generation requests a worker's log holds (renders and tokenizations left out)."""
    return [path for method, path, _, _ in log if path in ("/v1/completions", "/v1/chat/completions")]


def test_vllm_router_in_front_of_two_llmd_workers(engine_loops, tmp_path):
    logs: list[list] = [[], []]
    completion = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hello router"}], "max_tokens": 6, "temperature": 0}

    async def main():
        workers = [await start_worker(loop, KEY, log) for loop, log in zip(engine_loops, logs)]
        urls = [u for _, u in workers]
        router = router_or_skip()
        rr, rr_url, rr_log = start_router(router, urls, "round_robin", KEY, str(tmp_path))
        ca, ca_url, ca_log = start_router(router, urls, "cache_aware", KEY, str(tmp_path))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                direct = {}
                for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                    async with s.post(urls[0] + path, json=body, headers=AUTH) as r:
                        direct[path] = (await r.json())["choices"][0]
                await wait_healthy(s, rr_url, rr, rr_log, 60)  # 200 once its workers passed their checks
                await wait_healthy(s, ca_url, ca, ca_log, 60)
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
                stop(proc, 10)
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

