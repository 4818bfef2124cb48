"""Failures stay inside one request, against real daemon processes (``tiny_daemon.py``: the
daemon's lifecycle over the tiny random-GGUF engine, faults from ``LLMD_FAULT_INJECT``):

* while the model loads the socket already answers: ``/health`` 503 ``loading``, a completion
  503; then 200;
* a request whose postprocessing fails answers 500 while one beside it answers 200; a step
  that fails as a whole ends the stream that finished in it and a stream live beside it with
  one error event then ``[DONE]`` each; the next request answers 200; no block stays held
  and ``llmd:engine_errors_total`` counts the step;
* ``POST /v1/shutdown`` during a (long) load ends the process at once, socket removed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time

import aiohttp
import pytest
from tiny_daemon import start

from llmd.daemon.client.client import Client

FAULTS = "postprocess:501@2,step:502@3"


@pytest.fixture(scope="module")
def daemons():
    """(faulty daemon with a 1.5 s load, daemon with a 120 s load), started together."""
    tmp = tempfile.mkdtemp(prefix="llmd", dir="/tmp")
    path = lambda name: os.path.join(tmp, name)  # noqa: E731
    procs = [start(path("f.sock"), path("f.gguf"), path("f.log"), 1.5, dict(os.environ, LLMD_FAULT_INJECT=FAULTS)),
             start(path("s.sock"), path("s.gguf"), path("s.log"), 120.0)]
    yield [(path(f"{n}.sock"), path(f"{n}.log"), p) for n, p in zip("fs", procs)]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)


def wait_answering(sock: str, proc, timeout: float = 60.0) -> dict:
    """The first ``/health`` body (200 or 503) the daemon answers."""
    deadline = time.monotonic() + timeout
    while (h := Client(sock, timeout=5).health(ready_only=False)) is None:
        assert proc.poll() is None and time.monotonic() < deadline, "daemon did not answer"
        time.sleep(0.05)
    return h


def strict(raw):
    return json.loads(raw, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


async def scenario(sock: str):
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s:
        async def post(body):
            async with s.post("http://llmd/v1/completions", json=body) as r:
                return r.status, strict(await r.text())

        async def stream(body):
            async with s.post("http://llmd/v1/completions", json={**body, "stream": True}) as r:
                return [line[5:].strip() for line in (await r.text()).splitlines() if line.startswith("data:")]

        def req(seed, max_tokens):
            return {"prompt": f"p{seed}", "max_tokens": max_tokens, "temperature": 0, "seed": seed}

        failed, clean = await asyncio.gather(post(req(501, 8)), post(req(504, 8)))  # one fails alone
        long = asyncio.ensure_future(stream(req(503, 400)))
        await asyncio.sleep(0.3)  # running when the step fault fires
        short = await stream(req(502, 3))  # its last step fails: both streams end
        results = (failed, short, await long, clean, await post(req(505, 4)))
        async with s.get("http://llmd/metrics") as r:
            return results, await r.text()


def test_loading_then_failures_stay_inside_their_requests(daemons):
    (sock, log, proc), _ = daemons
    first = wait_answering(sock, proc)
    assert first["status"] == "loading", first
    with pytest.raises(Exception, match="503"):
        Client(sock).completion(prompt="hi", max_tokens=2)
    while Client(sock).health() is None:
        assert proc.poll() is None, open(log).read()
        time.sleep(0.05)
    (failed, short, long, clean, after), metrics = asyncio.run(asyncio.wait_for(scenario(sock), 60))
    assert failed[0] == 500 and "postprocessing failed" in failed[1]["error"]["message"]
    for events in (short, long):
        assert events[-1] == "[DONE]", events[-3:]
        ends = [e for e in map(strict, events[:-1]) if "error" in e or e["choices"][0]["finish_reason"]]
        assert len(ends) == 1 and "the engine step failed" in ends[0]["error"]["message"], ends
    assert clean[0] == 200 and after[0] == 200 and after[1]["choices"][0]["finish_reason"] == "length"
    assert 'llmd:engine_errors_total{model_name="tiny"} 1.0' in metrics
    st = Client(sock).stats()
    assert st["kv_cache"]["used"] == 0 and st["requests"] == [] and st["counters"]["requests_finished"]["error"] == 3
    assert "fault injection is on" in open(log).read()


def test_shutdown_while_loading_exits_at_once(daemons):
    _, (sock, log, proc) = daemons
    assert wait_answering(sock, proc)["status"] == "loading"
    Client(sock).shutdown()
    assert proc.wait(15) == 0, open(log).read()
    assert not os.path.exists(sock)
