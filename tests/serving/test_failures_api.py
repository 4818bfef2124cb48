"""One bad request never hurts the others, through the HTTP app (aiohttp's test client over a
real :class:`EngineLoop` and the tiny random-GGUF engine; faults from the test hook
``llmd.daemon.core.faults``): a request that fails alone answers 500 or an SSE error event
then ``[DONE]``; a failed step ends every live request exactly once (one that finished in
that step included), is counted, and the loop serves on; ``/health`` answers 503 while
loading, when stalled and when the engine thread is dead."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tiny_engine import tiny_engine

from llmd.daemon.core.faults import FaultInjector
from llmd.daemon.serving.api import ServerState, make_app
from llmd.daemon.serving.engine_health import STEP_BACKOFF_CAP_S, EngineHealth, step_backoff
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.metrics import DaemonMetrics


def _no_constant(name):
    raise AssertionError(f"{name} in JSON output")


def strict(raw: bytes | str):
    """JSON that refuses NaN / Infinity (not JSON, though Python writes them)."""
    return json.loads(raw, parse_constant=_no_constant)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("tiny") / "tiny.gguf", max_num_seqs=4)


@pytest.fixture
def engine_loop(engine):
    loop = EngineLoop(engine, "tiny", metrics=DaemonMetrics("tiny")).start()
    yield loop
    loop.stop()
    engine.faults = None
    assert engine.kv_manager.num_used_blocks == 0 and not engine.requests and not engine.detokenizers
    engine.kv_manager.check_integrity()


def run(engine_loop, scenario, timeout=60.0, **state_kw):
    """Run ``scenario(client)`` against a fresh app on ``engine_loop`` (a stranded request
    fails the test by timeout instead of hanging it)."""

    async def main():
        eng = engine_loop.engine
        state = ServerState(engine_loop=engine_loop, model_id="tiny", model_ids=("tiny",),
                            vocab_size=eng.model_config.vocab_size, max_model_len=eng.max_model_len,
                            shutdown=asyncio.Event(), metrics=engine_loop.metrics, **state_kw)
        async with TestClient(TestServer(make_app(state))) as client:
            return await asyncio.wait_for(scenario(client), timeout)

    return asyncio.run(main())


def body(seed, max_tokens=8, **kw):
    return {"prompt": f"p{seed}", "max_tokens": max_tokens, "temperature": 0, "seed": seed, "logprobs": 2, **kw}


async def stream_events(client, b) -> list:
    resp = await client.post("/v1/completions", json={**b, "stream": True})
    assert resp.status == 200
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            events.append("[DONE]" if data == b"[DONE]" else strict(data))
    return events


def terminal(events) -> list:
    """The terminal events of a one-choice stream: finish_reason chunks and error events."""
    return [e for e in events[:-1] if "error" in e or any(c["finish_reason"] for c in e["choices"])]


async def post(client, b):
    resp = await client.post("/v1/completions", json=b)
    return resp.status, strict(await resp.text())


def test_failed_request_is_500_or_error_event_and_others_go_on(engine_loop):
    """Postprocessing fault (non-streamed: 500 server_error) and NaN logits (streamed: an error
    event, then [DONE]); two clean requests beside them finish normally, no NaN in any body."""
    FaultInjector.parse("postprocess:101@2,nan:102@3").install(engine_loop.engine)

    async def scenario(client):
        return await asyncio.gather(post(client, body(101)), stream_events(client, body(102)),
                                    post(client, body(103)), stream_events(client, body(104)))

    (s1, b1), ev2, (s3, b3), ev4 = run(engine_loop, scenario)
    assert s1 == 500 and b1["error"]["type"] == "server_error" and "postprocessing failed" in b1["error"]["message"]
    assert ev2[-1] == "[DONE]" and len(terminal(ev2)) == 1 and "non-finite logits" in ev2[-2]["error"]["message"]
    assert s3 == 200 and b3["choices"][0]["finish_reason"] == "length" and len(b3["choices"][0]["text"]) == 8
    assert ev4[-1] == "[DONE]" and [c["finish_reason"] for c in terminal(ev4)[0]["choices"]] == ["length"]
    assert {k: v for k, v in engine_loop.engine.faults.fired.items() if v} == {"postprocess": 1, "nan": 1}


def test_failed_step_ends_every_request_once_and_the_loop_serves_on(engine_loop):
    """The step fault fires when seed 201 gets its 3rd token, its last (max_tokens 3): it left
    the scheduler in that step, yet gets its error event, as do the two long streams live
    then; exactly one terminal event each; the failure is counted; the next request answers."""
    FaultInjector.parse("step:201@3").install(engine_loop.engine)

    async def scenario(client):
        long = [asyncio.ensure_future(stream_events(client, body(s, 400))) for s in (202, 203)]
        for _ in range(500):
            if (await (await client.get("/v1/stats")).json())["scheduler"]["running"] == 2:
                break
            await asyncio.sleep(0.01)
        short = await stream_events(client, body(201, 3))
        events = [short, *await asyncio.gather(*long)]
        after = await post(client, body(204, 4))
        metrics = await (await client.get("/metrics")).text()
        return events, after, metrics

    events, (status, after), metrics = run(engine_loop, scenario)
    for ev in events:
        assert ev[-1] == "[DONE]" and len(terminal(ev)) == 1, ev[-3:]
        assert "the engine step failed" in ev[-2]["error"]["message"]
    assert status == 200 and after["choices"][0]["finish_reason"] == "length"
    assert 'llmd:engine_errors_total{model_name="tiny"} 1.0' in metrics
    assert 'llmd:request_success_total{finished_reason="error",model_name="tiny"} 3.0' in metrics
    assert engine_loop.health.engine_errors == 1 and engine_loop.health.step_failures == 0


def test_step_backoff_grows_to_a_cap():
    assert [step_backoff(n) for n in range(4)] == [0.0, 0.05, 0.1, 0.2]
    assert step_backoff(50) == STEP_BACKOFF_CAP_S
    h = EngineHealth()
    assert h.step_failed() == 0.05 and h.step_failed() == 0.1 and 0.05 < h.backoff_left() <= 0.1
    h.step_succeeded()
    assert h.step_failures == 0 and h.engine_errors == 2


def test_health_while_loading_counts_the_uptime():
    """`/health` (and so `llmd status`'s "up N s, loading the model") counts the seconds since
    the daemon started while the model loads; it answered 0 until the first stats snapshot."""
    loop = EngineLoop(lambda: None, "tiny")  # never started: the engine is still "loading"
    loop.started_at -= 7.0

    async def main():
        state = ServerState(engine_loop=loop, model_id="tiny", model_ids=("tiny",), vocab_size=0, max_model_len=0,
                            shutdown=asyncio.Event(), loaded=False)
        async with TestClient(TestServer(make_app(state))) as client:
            resp = await client.get("/health")
            return resp.status, await resp.json()

    status, health = asyncio.run(main())
    assert status == 503 and health["status"] == "loading" and 7.0 <= health["uptime_s"] < 60.0, health


def test_health_loading_stalled_then_dead(engine_loop):
    """503 ``loading`` (everything but /health, /metrics, /v1/shutdown refused meanwhile);
    503 ``stalled`` while a step hangs past the stall limit, 200 again after it; 503 ``dead``
    once the engine thread is gone, and a completion is then 503 too."""
    FaultInjector.parse("hang:301@1=1.5").install(engine_loop.engine)

    async def loading(client):
        return [(r.status, await r.json()) for r in [await client.get("/health"),
                                                      await client.post("/v1/completions", json=body(1)),
                                                      await client.get("/metrics")] if r.status != 200] + [None]

    health_loading, completion_loading, _ = run(engine_loop, loading, loaded=False)
    assert health_loading[0] == 503 and health_loading[1]["status"] == "loading"
    assert completion_loading[0] == 503 and "loading" in completion_loading[1]["error"]["message"]

    async def stalled(client):
        job = asyncio.ensure_future(post(client, body(301, 2)))
        seen = []
        while not job.done():
            resp = await client.get("/health")
            seen.append((resp.status, (await resp.json())["status"]))
            await asyncio.sleep(0.1)
        resp = await client.get("/health")
        return seen, await job, (resp.status, await resp.json())

    seen, (status, _), after = run(engine_loop, stalled, health_stall_timeout=0.5)
    assert (503, "stalled") in seen and status == 200 and after[0] == 200 and after[1]["status"] == "ok"
    engine_loop.stop()

    async def dead(client):
        resp = await client.get("/health")
        return (resp.status, await resp.json()), await post(client, body(2))

    (status, health), (completion_status, _) = run(engine_loop, dead)
    assert status == 503 and health["status"] == "dead" and "not running" in health["reason"]
    assert completion_status == 503
