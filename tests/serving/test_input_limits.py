"""Limits checked before any work is queued, and work kept off the engine thread and the event
loop: the HTTP app in-process over a real :class:`EngineLoop` and a tiny random-GGUF engine
(context 512 tokens; ``tiny_engine``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import jinja2
import pytest
from app_harness import run_app
from tiny_engine import ByteHF, tiny_engine

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.serving import http_common
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.multi_prompt import MAX_PROMPTS
from llmd.daemon.serving.prompt_fields import MAX_MESSAGES
from llmd.daemon.serving.validation import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS
from llmd.models.tokenizer import Tokenizer


def run(engine_loop, scenario):
    return run_app(engine_loop, scenario)


def msgs(k: int) -> list[dict]:
    return [{"role": "user", "content": "hi"}] * k


def test_limits_are_400s_naming_the_field_before_anything_is_queued(engine_loop):
    """Each limit: a 400 naming its field, decided before tokenizing or queueing (the engine
    counts no rejection, holds no block); a token-id prompt of a million ids is refused on its
    length before any per-id check."""
    ctx = engine_loop.engine.max_model_len
    cases = [
        ("/v1/completions", {"prompt": [1] * 1_000_000}, "prompt", f"{1_000_000} tokens but the context is {ctx}"),
        ("/v1/completions", {"prompt": [1] * ctx}, "prompt", "leaving no room"),
        ("/v1/chat/completions", {"messages": msgs(MAX_MESSAGES + 1)}, "messages", f"limit of {MAX_MESSAGES}"),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids",
         f"limit of {MAX_STOP_TOKEN_IDS}"),
        ("/v1/completions", {"prompt": "a", "stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop",
         f"limit of {MAX_STOP_CHARS}"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
         "logit_bias", f"limit of {MAX_LOGIT_BIAS}"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"256": 10}}, "logit_bias", "outside the vocabulary"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "decimal strings"),
        ("/v1/completions", {"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt", f"limit of {MAX_PROMPTS}"),
        ("/v1/completions", {"prompt": ["a", [1, 999]]}, "prompt", "prompt[1]: prompt has token id 999"),
        ("/tokenize", {"prompt": [1] * ctx}, "prompt", "leaving no room"),
        ("/tokenize", {"messages": msgs(MAX_MESSAGES + 1)}, "messages", f"limit of {MAX_MESSAGES}"),
        ("/tokenize", {"prompt": "x" * (64 * ctx + 1)}, "prompt", "characters"),
        ("/tokenize", {"prompt": [ctx, 999]}, "prompt", "outside the vocabulary"),
        ("/tokenize", {"messages": [{"role": "user", "content": ""}]}, "messages[0].content", "empty"),
    ]
    rejected = engine_loop.engine.counters.requests_rejected

    async def scenario(client):
        out = []
        for path, body, _, _ in cases:
            t0 = time.perf_counter()
            resp = await client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
            out.append((resp.status, await resp.json(), time.perf_counter() - t0))
        return out

    for (path, body, param, words), (status, err, _) in zip(cases, run(engine_loop, scenario)):
        assert status == 400 and err["error"]["param"] == param and words in err["error"]["message"], (path, err)
    assert engine_loop.engine.counters.requests_rejected == rejected  # the engine never saw them
    assert engine_loop.engine.kv_manager.num_used_blocks == 0


def test_integer_fields_take_integral_numbers_only(engine_loop):
    """``max_tokens: 3.0`` / ``n: 2.0`` / ``seed: 7.0`` are those integers (pydantic's lax mode in
    vLLM); ``max_tokens: 3.5`` and ``n: "2"`` are 400s naming the field."""

    async def scenario(client):
        out = []
        for body in ({"max_tokens": 3.0, "n": 2.0, "seed": 7.0, "temperature": 0.8},
                     {"max_tokens": 3, "n": 2, "seed": 7, "temperature": 0.8}, {"max_tokens": 3.5}, {"n": "2"}):
            resp = await client.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True, **body})
            out.append((resp.status, await resp.json()))
        return out

    (s1, floats), (s2, ints), (s3, half), (s4, text) = run(engine_loop, scenario)
    assert s1 == s2 == 200 and [c["text"] for c in floats["choices"]] == [c["text"] for c in ints["choices"]]
    assert floats["usage"]["completion_tokens"] == 6
    assert s3 == 400 and half["error"]["param"] == "max_tokens"
    assert "integer, got number 3.5" in half["error"]["message"]
    assert s4 == 400 and text["error"]["param"] == "n"


def test_stop_token_ids_are_a_set_and_tokenize_takes_every_prompt_form(engine_loop):
    """Duplicated stop token ids at the cap are accepted (a set) and stop generation; /tokenize
    takes text, token ids and messages as generation does."""

    async def scenario(client):
        resp = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0})
        text = (await resp.json())["choices"][0]["text"]
        stop = [ord(text[2])] * MAX_STOP_TOKEN_IDS
        resp = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0,
                                                          "stop_token_ids": stop})
        stopped = await resp.json()
        toks = [await (await client.post("/tokenize", json=b)).json()
                for b in ({"prompt": "ab"}, {"prompt": [97, 98]}, {"messages": [{"role": "user", "content": "ab"}]})]
        return text, stopped, toks

    text, stopped, toks = run(engine_loop, scenario)
    assert stopped["choices"][0]["finish_reason"] == "stop" and text.startswith(stopped["choices"][0]["text"])
    assert toks[0]["tokens"] == toks[1]["tokens"] == [97, 98]
    assert toks[2]["tokens"] == [ord(c) for c in "user: ab\nassistant: "]


class _EncodingHF(ByteHF):
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 256 for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")


@pytest.mark.parametrize("template", [None, "{{ raise_exception('x') }}"])
def test_chat_messages_a_model_cannot_render_are_400_on_tokenize_and_chat(tmp_path, template):
    """A model without a chat template (Gemma 3 270M's GGUF has none), or a template that raises
    (jinja2's TemplateError, e.g. Gemma's role alternation): 400 on /tokenize and on chat."""
    engine = tiny_engine(tmp_path / "tiny.gguf")
    engine.tokenizer = Tokenizer(_EncodingHF(), dataclasses.replace(engine.model_config, chat_template=template))
    engine.input_processor.tokenizer = engine.tokenizer
    loop = EngineLoop(engine, "tiny").start()
    try:
        async def scenario(client):
            out = []
            for path in ("/tokenize", "/v1/chat/completions"):
                resp = await client.post(path, json={"messages": msgs(2)})
                out.append((resp.status, await resp.json()))
            return out

        for status, err in run(loop, scenario):
            assert status == 400 and err["error"]["param"] == "messages", err
            assert ("no chat template" if template is None else "refused the messages") in err["error"]["message"]
    finally:
        loop.stop()


def test_prompts_are_tokenized_off_the_engine_thread_and_big_bodies_decoded_off_the_loop(engine_loop, monkeypatch):
    """The engine thread receives token ids only: every encode and chat render runs on the
    tokenizer pool (generation and /tokenize alike); a body over the threshold is decoded on a
    worker thread, a small one inline."""
    tok = engine_loop.engine.tokenizer
    threads: list[str] = []
    for name in ("encode", "apply_chat"):
        orig = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, _o=orig, **k: (threads.append(threading.current_thread().name),
                                                                    _o(*a, **k))[1])
    decoded: list[tuple[int, str]] = []
    loads = json.loads
    monkeypatch.setattr(http_common.json, "loads", lambda raw, *a, **k: (decoded.append(
        (len(raw), threading.current_thread().name)), loads(raw, *a, **k))[1])

    async def scenario(client):
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        await client.post("/v1/chat/completions", json={"messages": msgs(1), "max_tokens": 2})
        await client.post("/tokenize", json={"prompt": "hi"})
        await client.post("/tokenize", json={"prompt": "x" * (http_common.JSON_OFF_LOOP_BYTES + 1)})
        return threading.current_thread().name

    loop_thread = run(engine_loop, scenario)
    assert len(threads) >= 3 and all(t.startswith("llmd-tokenize") for t in threads), threads
    small, big = [d for d in decoded if d[0] < 100], [d for d in decoded if d[0] > http_common.JSON_OFF_LOOP_BYTES]
    assert small and all(t == loop_thread for _, t in small)
    assert big and all(t != loop_thread for _, t in big)


def test_unknown_id_aborts_do_not_rebuild_the_snapshot(engine_loop, monkeypatch):
    """1,000 aborts of unknown ids while a request runs rebuild the stats snapshot a handful of
    times (its interval), not once per command."""
    eng = engine_loop.engine
    builds = []
    orig = eng.make_stats
    monkeypatch.setattr(eng, "make_stats", lambda: (builds.append(1), orig())[1])

    async def scenario(client):
        resp = await client.post("/v1/completions", json={"prompt": "go", "max_tokens": 400, "stream": True})
        await resp.content.readline()
        futs = [engine_loop.abort(f"nope-{i}") for i in range(1000)]
        t0 = time.monotonic()
        found = [await asyncio.wrap_future(f) for f in futs]
        elapsed = time.monotonic() - t0
        n = len(builds)
        await resp.release()
        return found, elapsed, n

    found, elapsed, n = run(engine_loop, scenario)
    assert not any(found)
    assert n <= 3 + elapsed / engine_loop.snapshot_interval, (n, elapsed)


def test_engine_loop_counts_prompts_the_tokenizer_pool_refused(engine_loop):
    """A prompt refused while tokenizing (too long for the context) still counts as rejected
    in the engine's stats, and nothing is queued."""
    before = engine_loop.engine.counters.requests_rejected
    from llmd.daemon.core.request import SamplingParams

    fut = engine_loop.submit("too-long", "x" * 600, SamplingParams(max_tokens=1), 1, lambda out: None)
    with pytest.raises(LlmdError, match="no room"):
        fut.result(10)
    deadline = time.monotonic() + 5
    while engine_loop.snapshot()["counters"]["requests_rejected"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_loop.engine.counters.requests_rejected == before + 1
