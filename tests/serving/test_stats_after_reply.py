"""``GET /v1/stats`` right after a reply's end: the finished request is gone and its blocks are
free. The engine thread republished its snapshot only every ``snapshot_interval`` while others
ran, so a client checking for leaked blocks saw the finished request still ``running`` (a
fresh-user report: ``generated_tokens 17`` of 20, 2 blocks used); a step that finishes requests now
takes a light snapshot before their last outputs go out (``engine_thread._publish_snapshot``)."""

from __future__ import annotations

import asyncio

import pytest
from app_harness import run_app, start_loop


@pytest.fixture(scope="module")
def engine_loop(tmp_path_factory):
    loop = start_loop(tmp_path_factory)
    loop.snapshot_interval = 60.0  # no scheduled rebuild during the test: only the finish's own
    yield loop
    loop.stop()


def test_stats_read_after_a_reply_show_it_finished_while_another_runs(engine_loop):
    async def scenario(client):
        long = asyncio.ensure_future(client.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}))
        for _ in range(500):  # the submit's own rebuild shows it running
            st = await (await client.get("/v1/stats")).json()
            if st["scheduler"]["running"] == 1:
                break
            await asyncio.sleep(0.01)
        before = st["kv_cache"]["used"]
        resp = await client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 20,
                                                          "ignore_eos": True, "temperature": 0})
        body = await resp.json()
        st = await (await client.get("/v1/stats")).json()  # at once, on the next request
        still_long = engine_loop.num_live == 1  # the long one has not finished yet
        stream = await long
        await stream.release()
        return body, st, before, still_long

    body, st, before, still_long = run_app(engine_loop, scenario, timeout=60)
    assert body["usage"]["completion_tokens"] == 20
    assert still_long, "the long request ended before the check: the test proves nothing"
    assert len(st["requests"]) == 1 and st["scheduler"]["running"] == 1, st["requests"]  # only the long one
    assert st["counters"]["requests_finished"].get("length") == 1, st["counters"]
    held = sum(r["blocks"] for r in st["requests"])
    assert st["kv_cache"]["used"] == held >= before, (st["kv_cache"], held, before)
    assert st["block_map"]["encoding"] == "rle"  # reused from the last full snapshot
