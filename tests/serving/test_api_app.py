"""The HTTP app in-process: aiohttp's test client on ``make_app`` over a real :class:`EngineLoop`
and a tiny random-GGUF engine (``tiny_engine``), so route logic is tested in milliseconds
(the subprocess daemons of ``test_server_api.py`` test the real model and process)."""

from __future__ import annotations

import asyncio
import json

import pytest
from app_harness import run_app, sse_events, start_loop

from llmd.daemon.protocol import STATS_SCHEMA_VERSION


@pytest.fixture(scope="module")
def engine_loop(tmp_path_factory):
    """One engine loop for the module: at most 2 sequences running and 1 waiting."""
    loop = start_loop(tmp_path_factory, metrics=True, max_num_seqs=2, max_num_waiting=1)
    yield loop
    loop.stop()


def run(engine_loop, scenario):
    """Run ``scenario(client)`` against a fresh app on ``engine_loop``."""
    return run_app(engine_loop, scenario, model_ids=("tiny", "tiny-alias"))


def test_completion_n_choices_and_stream_equal_non_stream(engine_loop):
    """n = 2 greedy: two choices with their index; the stream carries each choice's index,
    joins to the same texts, ends with usage then ``[DONE]``."""
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "n": 2}

    async def scenario(client):
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        full = await resp.json()
        resp = await client.post("/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}})
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        return full, await sse_events(resp)

    full, events = run(engine_loop, scenario)
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" and len(c["text"]) == 6 for c in full["choices"])
    assert full["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 12
    texts = {0: "", 1: ""}
    for ev in events[:-2]:
        for ch in ev["choices"]:
            texts[ch["index"]] += ch["text"]
    assert texts == {0: full["choices"][0]["text"], 1: full["choices"][1]["text"]}


def test_errors_carry_their_field(engine_loop):
    """Validation and engine rejections name the field: the engine's errors carry it."""
    cases = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # validation
        ("/v1/completions", {"prompt": "x" * 500, "max_tokens": 20}, "max_tokens"),  # engine: beyond the context
        ("/v1/completions", {"prompt": "x" * 600}, "prompt"),  # engine: no room to generate
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 600}]}, "messages"),
        ("/v1/completions", {"prompt": "hi", "n": 3, "max_tokens": 2}, "n"),  # engine: n > --max-num-seqs 2
        ("/v1/completions", {"prompt": "hi", "model": "other"}, "model"),
        ("/v1/completions", {"prompt": "x" * (64 * 512 + 1)}, "prompt"),  # refused before tokenizing
    ]

    async def scenario(client):
        out = []
        for path, body, _ in cases:
            resp = await client.post(path, json=body)
            out.append((resp.status, await resp.json()))
        resp = await client.post("/v1/completions", data=b"{not json")
        out.append((resp.status, await resp.json()))
        # an integer past Python's 4,300-digit conversion limit (json.loads raises a plain ValueError)
        resp = await client.post("/v1/completions", data=b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}")
        out.append((resp.status, await resp.json()))
        return out

    results = run(engine_loop, scenario)
    for (path, body, param), (status, err) in zip(cases, results):
        code = "model_not_found" if param == "model" else 400  # an unknown model: 404, OpenAI's code
        assert status == (404 if param == "model" else 400), (body, err)
        assert err["error"]["param"] == param, (body, err)
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == code
    assert all(status == 400 and "not valid JSON" in err["error"]["message"] for status, err in results[-2:])
    assert engine_loop.engine.kv_manager.num_used_blocks == 0  # rejected requests hold nothing


def test_full_queue_is_429_with_retry_after(engine_loop):
    """2 running + 1 waiting fill the engine; a fourth request then gets 429 + Retry-After, and
    the others are answered."""

    async def scenario(client):
        async def one(i):
            resp = await client.post("/v1/completions", json={"prompt": f"r{i}", "max_tokens": 400, "temperature": 0})
            return resp.status, resp.headers.get("Retry-After"), await resp.json()

        async def until(key, n):
            for _ in range(500):
                if (await (await client.get("/v1/stats")).json())["scheduler"][key] == n:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"never {n} {key}")

        others = []
        for i, (key, n) in enumerate((("running", 1), ("running", 2), ("waiting", 1))):
            others.append(asyncio.ensure_future(one(i)))  # one at a time: the queue holds only one
            await until(key, n)
        busy = await one(3)
        return busy, await asyncio.gather(*others)

    busy, others = run(engine_loop, scenario)
    assert busy[0] == 429 and busy[1] == "1" and "waiting queue is full" in busy[2]["error"]["message"]
    assert [s for s, _, _ in others] == [200, 200, 200]
    assert all(len(r["choices"][0]["text"]) == 400 for _, _, r in others)


def test_tokenize_stats_health_models_metrics_abort(engine_loop):
    async def scenario(client):
        out = {}
        resp = await client.post("/tokenize", json={"prompt": "abc"})
        out["tokenize"] = await resp.json()
        resp = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        out["tokenize_chat"] = await resp.json()
        await (await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 3, "temperature": 0})).json()
        for _ in range(500):  # the snapshot is republished once the engine thread is idle again
            out["stats"] = await (await client.get("/v1/stats")).json()
            if not out["stats"]["requests"]:
                break
            await asyncio.sleep(0.01)
        for name, path in (("health", "/health"), ("models", "/v1/models"), ("cells", "/v1/stats?cells=4")):
            out[name] = await (await client.get(path)).json()
        resp = await client.get("/metrics")
        out["metrics"] = (resp.status, await resp.text())
        resp = await client.delete("/v1/requests/no-such-request")
        out["abort"] = (resp.status, await resp.json())
        out["reset"] = await (await client.post("/v1/cache/reset")).json()
        return out

    out = run(engine_loop, scenario)
    assert out["tokenize"] == {"tokens": [97, 98, 99], "count": 3, "max_model_len": 512}
    assert out["tokenize_chat"]["tokens"] == [ord(c) for c in "user: hi\nassistant: "]
    assert out["health"]["status"] == "ok" and out["health"]["model_ids"] == ["tiny", "tiny-alias"]
    assert out["models"]["data"][0]["id"] == "tiny" and out["models"]["data"][0]["max_model_len"] == 512
    st = out["stats"]
    assert st["schema_version"] == STATS_SCHEMA_VERSION and st["model"] == "tiny"
    assert st["counters"]["generation_tokens"] >= 3 and st["counters"]["requests_finished"]["length"] >= 1
    assert st["scheduler"] == {"running": 0, "waiting": 0, "preempted": 0, "context_shifts": 0} and st["requests"] == []
    assert st["kv_cache"]["used"] == 0 and st["block_map"]["encoding"] == "rle"
    assert out["cells"]["block_map"]["encoding"] == "cells" and len(out["cells"]["block_map"]["cells"]) == 4
    status, text = out["metrics"]
    assert status == 200 and 'llmd:generation_tokens_total{model_name="tiny"}' in text
    assert out["abort"][0] == 404 and out["abort"][1]["error"]["param"] == "request_id"
    assert "reset" in out["reset"]


def test_delete_by_parent_id_aborts_every_sequence(engine_loop):
    """``DELETE /v1/requests/{id}`` with the response id aborts all n sequences: each stream
    choice ends with ``finish_reason: "abort"``, then ``[DONE]``; no block stays held."""

    async def scenario(client):
        resp = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 400, "n": 2, "stream": True})
        finish, rid, aborted = {}, None, None
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if rid is None:
                rid = ev["id"]
                r = await client.delete(f"/v1/requests/{rid}")
                aborted = (r.status, await r.json())
            for ch in ev["choices"]:
                if ch["finish_reason"]:
                    finish[ch["index"]] = ch["finish_reason"]
        return rid, aborted, finish

    rid, aborted, finish = run(engine_loop, scenario)
    assert aborted == (200, {"id": rid, "aborted": True})
    assert finish == {0: "abort", 1: "abort"}
    assert engine_loop.engine.kv_manager.num_used_blocks == 0 and rid not in engine_loop.engine.parallel


def test_detokenize_decodes_on_the_tokenizer_pool_and_version_is_the_installed_one(engine_loop, monkeypatch):
    """``POST /detokenize`` (vLLM's): ``{"tokens"}`` → ``{"prompt"}``, special tokens kept, decoded
    on the tokenizer pool; ``model`` checked as generation checks it (and by ``/tokenize``);
    ``/tokenize``'s ids round-trip. ``GET /version``: the installed llmd's version, as vLLM reports its own."""
    import importlib.metadata
    import threading

    tok = engine_loop.engine.input_processor.tokenizer
    calls: list[tuple[str, dict]] = []
    orig = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **k: (calls.append((threading.current_thread().name, k)),
                                                         orig(ids, **k))[1])

    async def scenario(client):
        out = {}
        for name, body in (("hi", {"tokens": [104, 105]}), ("alias", {"tokens": [97], "model": "tiny-alias"}),
                           ("empty", {"tokens": []}), ("other", {"tokens": [97], "model": "other"})):
            resp = await client.post("/detokenize", json=body)
            out[name] = (resp.status, await resp.json())
        ids = (await (await client.post("/tokenize", json={"prompt": "round trip", "model": "tiny"})).json())["tokens"]
        resp = await client.post("/tokenize", json={"prompt": 5, "model": "other"})  # the model first, as generation
        out["tokenize other"] = (resp.status, await resp.json())
        resp = await client.post("/detokenize", json={"tokens": "x", "model": "other"})
        out["detokenize other"] = (resp.status, await resp.json())
        out["round"] = await (await client.post("/detokenize", json={"tokens": ids})).json()
        resp = await client.get("/version")
        out["version"] = (resp.status, await resp.json())
        return out

    out = run(engine_loop, scenario)
    assert out["hi"] == (200, {"prompt": "hi"}) and out["alias"] == (200, {"prompt": "a"})
    assert out["empty"] == (200, {"prompt": ""}) and out["round"] == {"prompt": "round trip"}
    for key in ("other", "tokenize other", "detokenize other"):
        assert out[key][0] == 404 and out[key][1]["error"]["code"] == "model_not_found", key
    assert calls and all(t.startswith("llmd-tokenize") and k == {"skip_special_tokens": False} for t, k in calls)
    assert out["version"] == (200, {"version": importlib.metadata.version("llmd")})


@pytest.mark.parametrize("body, words", [
    ({}, "tokens is required"),
    ({"tokens": None}, "tokens is required"),
    ({"tokens": "hi"}, 'got string "hi"'),
    ({"tokens": {"0": 1}}, "got object"),
    ({"tokens": [1, True]}, "got boolean true in it"),
    ({"tokens": [1, 2.5]}, "got number 2.5 in it"),
    ({"tokens": [1, "2"]}, 'got string "2" in it'),
    ({"tokens": [1, [2]]}, "got array"),
    ({"tokens": [256]}, "token id 256 outside the vocabulary [0, 256)"),
    ({"tokens": [-1]}, "token id -1 outside the vocabulary"),
    ({"tokens": [-1] * (64 * 512 + 1)}, f"{64 * 512 + 1} ids, more than the limit of {64 * 512}"),  # count first
])
def test_detokenize_bad_tokens_are_400s_naming_the_field(engine_loop, body, words):
    """What ``/detokenize`` refuses, each a 400 ``param: "tokens"``: missing, not a list, an
    element not an integer id of the vocabulary, more ids than any prompt may carry (64 × the
    context, counted before any id is checked)."""

    async def scenario(client):
        resp = await client.post("/detokenize", json=body)
        bad = (resp.status, await resp.json())
        resp = await client.post("/detokenize", json=[1, 2])  # not an object: no field to name
        return bad, (resp.status, await resp.json())

    (status, err), (status2, err2) = run(engine_loop, scenario)
    assert status == 400 and err["error"]["param"] == "tokens" and words in err["error"]["message"], err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == 400
    assert status2 == 400 and err2["error"]["param"] is None and "JSON object" in err2["error"]["message"]
