"""Beam search over HTTP (vLLM's extra parameters): ``use_beam_search``, ``n`` beams,
``length_penalty``, ``early_stopping`` on /v1/completions and /v1/chat/completions, the n
best beams as choices (best first), 400s naming the field for what it does not combine with,
and ``DELETE`` of any of a search's ids aborting the whole search."""

from __future__ import annotations

import asyncio

import pytest
from app_harness import run_app, start_loop
from tiny_engine import tiny_engine

from llmd.daemon.core.parallel import child_request_ids
from llmd.daemon.core.request import SamplingParams


@pytest.fixture(scope="module")
def engine_loop(tmp_path_factory):
    loop = start_loop(tmp_path_factory, metrics=True, max_num_seqs=4)
    yield loop
    loop.stop()


def run(engine_loop, scenario):
    return run_app(engine_loop, scenario)


def test_beam_choices_over_http(engine_loop, tmp_path):
    """n = 3 beams (temperature defaults to 0 with use_beam_search): three distinct choices in
    rank order, usage summed over them; chat too."""
    body = {"prompt": "hello", "max_tokens": 6, "n": 3, "use_beam_search": True, "length_penalty": 0.5,
            "early_stopping": "never"}

    async def scenario(client):
        a = await client.post("/v1/completions", json=body)
        b = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 4, "n": 2, "use_beam_search": True})
        return a.status, await a.json(), b.status, await b.json()

    sa, full, sb, chat = run(engine_loop, scenario)
    assert sa == 200 and sb == 200, (full, chat)
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in full["choices"]]
    assert len(set(texts)) == 3 and all(len(t) == 6 for t in texts)
    assert full["usage"]["completion_tokens"] == 18
    # the same search on an engine of its own over the same tiny weights (seeded)
    eng = tiny_engine(tmp_path / "same.gguf")
    sp = SamplingParams(max_tokens=6, temperature=0.0, use_beam_search=True, length_penalty=0.5,
                        early_stopping="never")
    eng.add_parallel_request("hello", sp, child_request_ids("direct", 3), parent_id="direct")
    got = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.index] = o.new_text
    assert [got[i] for i in range(3)] == texts
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert len({c["message"]["content"] for c in chat["choices"]}) == 2
    assert engine_loop.engine.kv_manager.num_used_blocks == 0


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"),
    ({"temperature": 0.7}, "temperature"),
    ({"n": 1}, "n"),
    ({"logprobs": 2}, "logprobs"),
    ({"stop": ["x"]}, "stop"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_invalid_beam_combinations_are_400s(engine_loop, extra, param):
    body = {"prompt": "hi", "max_tokens": 3, "n": 2, "use_beam_search": True, **extra}

    async def scenario(client):
        resp = await client.post("/v1/completions", json=body)
        return resp.status, await resp.json()

    status, err = run(engine_loop, scenario)
    assert status == 400 and err["error"]["param"] == param, err


@pytest.mark.parametrize("suffix", ["-2", "-0", ""])
def test_delete_of_any_beams_id_aborts_the_whole_search(engine_loop, suffix):
    """``DELETE /v1/requests/{id}-k`` (one beam's sequence id, as ``/v1/stats`` lists them)
    ends the search as ``DELETE /v1/requests/{id}`` does: one 200 answer whose every choice
    has ``finish_reason: "abort"`` and a beam's text so far, every beam's blocks freed. Before,
    only slot k ended (its choice "abort") and the other beams searched on to ``max_tokens``."""
    body = {"prompt": "hello", "max_tokens": 400, "n": 4, "use_beam_search": True, "ignore_eos": True}

    async def scenario(client):
        answer = asyncio.ensure_future(client.post("/v1/completions", json=body))
        for _ in range(1000):  # until every beam holds a few tokens
            reqs = (await (await client.get("/v1/stats")).json())["requests"]
            live = [r["id"] for r in reqs]
            if live and min(r["generated_tokens"] for r in reqs) >= 3:
                break
            await asyncio.sleep(0.01)
        rid = live[0].rsplit("-", 1)[0]
        deleted = await client.delete(f"/v1/requests/{rid}{suffix}")
        resp = await answer
        return rid, sorted(live), deleted.status, await deleted.json(), resp.status, await resp.json()

    rid, live, status, deleted, answer_status, answer = run_app(engine_loop, scenario, timeout=120)
    assert live == child_request_ids(rid, 4)
    assert (status, deleted) == (200, {"id": rid + suffix, "aborted": True})
    assert answer_status == 200 and answer["id"] == rid, answer
    assert [(c["index"], c["finish_reason"]) for c in answer["choices"]] == [(i, "abort") for i in range(4)]
    # the search's answer so far: each choice a beam's text (not "" beside a token count, as before)
    assert all(c["text"] for c in answer["choices"]) and answer["usage"]["completion_tokens"] >= 4 * 3, answer
    assert engine_loop.engine.kv_manager.num_used_blocks == 0 and not engine_loop.engine.requests
    assert rid not in engine_loop.engine.parallel
