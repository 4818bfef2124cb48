"""Structured outputs and tool calls over HTTP: the in-process aiohttp app on an EngineLoop around
the real SmolLM2 (float32). ``response_format`` (json_schema, json_object), vLLM's
``structured_outputs`` / ``guided_*``, streaming with n > 1, ``tool_choice`` named and
required (OpenAI ``tool_calls``), and the 400s for bad constraints (nothing queued)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer

from llmd.daemon.serving.api import ServerState, make_app
from llmd.daemon.serving.engine_loop import EngineLoop

pytestmark = pytest.mark.slow

RATING = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["color", "score"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


@pytest.fixture(scope="module")
def engine_loop(make_engine):
    loop = EngineLoop(make_engine(), "smollm2-135m").start()
    yield loop
    loop.stop()


def run(engine_loop, scenario, timeout=120.0):
    async def main():
        eng = engine_loop.engine
        state = ServerState(engine_loop=engine_loop, model_id="smollm2-135m", model_ids=("smollm2-135m",),
                            vocab_size=eng.model_config.vocab_size, max_model_len=eng.max_model_len,
                            shutdown=asyncio.Event())
        async with TestClient(TestServer(make_app(state))) as client:
            return await asyncio.wait_for(scenario(client), timeout)

    return asyncio.run(main())


def chat(text: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 48, "temperature": 0, **kw}


async def events(resp) -> list:
    out = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            out.append(json.loads(line[5:]))
    return out


def test_json_schema_json_object_regex_and_streamed_n(engine_loop):
    """Non-streamed json_schema and json_object replies parse (and validate); a streamed n = 2
    sampled json_schema request joins to two valid replies per index; /v1/completions takes
    ``structured_outputs.regex`` and ``guided_choice``."""
    fmt = {"type": "json_schema", "json_schema": {"name": "rating", "schema": RATING, "strict": True}}

    async def scenario(client):
        a = await (await client.post("/v1/chat/completions", json=chat("Rate the sky.", response_format=fmt))).json()
        b = await (await client.post("/v1/chat/completions",
                                     json=chat("Give a JSON object about cats.", max_tokens=24,
                                               response_format={"type": "json_object"}))).json()
        resp = await client.post("/v1/chat/completions", json=chat("Rate the sea.", response_format=fmt, n=2,
                                                                   temperature=0.9, seed=5, stream=True))
        streamed = await events(resp)
        c = await (await client.post("/v1/completions", json={"prompt": "The year is", "max_tokens": 8,
                                                              "temperature": 0,
                                                              "structured_outputs": {"regex": "[0-9]{4}"}})).json()
        d = await (await client.post("/v1/completions", json={"prompt": "Is water wet?", "max_tokens": 8,
                                                              "guided_choice": ["yes", "no"]})).json()
        return a, b, streamed, c, d

    a, b, streamed, c, d = run(engine_loop, scenario)
    assert a["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(a["choices"][0]["message"]["content"]), RATING)
    obj = b["choices"][0]
    assert obj["message"]["content"].startswith("{")
    if obj["finish_reason"] == "stop":  # a length cut keeps the truncated text
        assert isinstance(json.loads(obj["message"]["content"]), dict)
    texts, finish = {0: "", 1: ""}, {}
    for ev in streamed:
        for ch in ev["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
            finish[ch["index"]] = ch["finish_reason"] or finish.get(ch["index"])
    assert finish == {0: "stop", 1: "stop"}
    for t in texts.values():
        jsonschema.validate(json.loads(t), RATING)
    assert len(c["choices"][0]["text"]) == 4 and c["choices"][0]["text"].isdigit()
    assert d["choices"][0]["text"] in ("yes", "no") and d["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_named_and_required_return_tool_calls(engine_loop):
    """A named function: one tool call whose arguments validate against its parameters
    (finish_reason "tool_calls", content null), streamed as one tool_calls delta; "required":
    calls of listed tools whose arguments validate; the call sent back as an assistant turn
    (content null) with the tool's result is accepted, a malformed one is a 400."""
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def scenario(client):
        a = await (await client.post("/v1/chat/completions", json=chat("Weather in Paris?", tools=TOOLS,
                                                                       tool_choice=named))).json()
        resp = await client.post("/v1/chat/completions", json=chat("Weather in Rome?", tools=TOOLS, tool_choice=named,
                                                                   stream=True))
        streamed = await events(resp)
        b = await (await client.post("/v1/chat/completions", json=chat("What time is it in UTC?", tools=TOOLS,
                                                                       tool_choice="required", max_tokens=64,
                                                                       parallel_tool_calls=False))).json()
        call = a["choices"][0]["message"]["tool_calls"][0]
        turns = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "22 C, sunny"}]
        back = await client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 4, "tools": TOOLS,
                                                               "tool_choice": "none"})
        turns[1]["tool_calls"] = [{"type": "function", "function": {"name": "get_weather"}}]
        bad = await client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 4})
        return a, streamed, b, (back.status, await back.json()), (bad.status, await bad.json())

    a, streamed, b, back, bad = run(engine_loop, scenario)
    assert back[0] == 200 and isinstance(back[1]["choices"][0]["message"]["content"], str)  # the round trip
    assert bad[0] == 400 and bad[1]["error"]["param"] == "messages[1].tool_calls[0]"
    choice = a["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    last = streamed[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert not any(ch["delta"].get("content") for ev in streamed[:-1] for ch in ev["choices"])
    (scall,) = last["delta"]["tool_calls"]
    assert scall["index"] == 0 and scall["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(scall["function"]["arguments"]), WEATHER)
    choice = b["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]  # parallel_tool_calls false: exactly one
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_chat_logprob_bytes_join_to_the_reply_where_tokens_split_characters(engine_loop):
    """SmolLM2 spells an emoji or a CJK character in several byte-level tokens: each token's
    ``bytes`` are its own raw bytes, so they join to the reply's UTF-8 (streamed and not); they
    were EF BF BD (U+FFFD) for every partial token."""
    text = "😀 日本語"
    body = chat("Say it.", guided_choice=[text], logprobs=True, top_logprobs=2)

    async def scenario(client):
        whole = await (await client.post("/v1/chat/completions", json=body)).json()
        streamed = await events(await client.post("/v1/chat/completions", json={**body, "stream": True}))
        return whole, streamed

    whole, streamed = run(engine_loop, scenario)
    choice = whole["choices"][0]
    assert choice["message"]["content"] == text and choice["finish_reason"] == "stop"
    entries = choice["logprobs"]["content"]
    assert any("\ufffd" in e["token"] for e in entries)  # some tokens do hold part of a character
    assert b"".join(bytes(e["bytes"]) for e in entries[:-1]).decode() == text  # the last: the stop token
    streamed_entries = [e for ev in streamed for ch in ev["choices"] for e in (ch["logprobs"] or {}).get("content", [])]
    assert [e["bytes"] for e in streamed_entries] == [e["bytes"] for e in entries]
    for e in entries:
        for top in e["top_logprobs"]:
            assert bytes(top["bytes"]).decode("utf-8", "replace") == top["token"] or "\ufffd" in top["token"]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    # compile, but match no text: the sampler found no allowed token at the first step (a 500)
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": TOOLS}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),  # OpenAI and vLLM refuse it without tools too
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    # a tool whose parameters xgrammar refuses is named (it was "tools")
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "x", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    # arguments that are not an object: a bare number was served as a call's arguments
    ({"tools": [{"type": "function", "function": {"name": "b", "parameters": {"type": "integer"}}}],
      "tool_choice": {"type": "function", "function": {"name": "b"}}}, "tools[0].function.parameters"),
    # misspelt keys: they gave unconstrained output / any JSON object with a 200
    ({"structured_outputs": {"regexp": "[0-9]"}}, "structured_outputs.regexp"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "scheme": {"type": "object"}}}},
     "response_format.json_schema.scheme"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render"])
def test_bad_constraints_are_400_naming_the_field(engine_loop, extra, param, path):
    """Each malformed or uncompilable constraint is a 400 whose ``param`` names the field, from
    generation and from its render endpoint alike (render compiled none before: a 200);
    nothing is queued (no request reaches the scheduler)."""
    async def scenario(client):
        resp = await client.post(path, json=chat("Hi", **extra))
        return resp.status, await resp.json()

    admitted = engine_loop.engine.counters.requests_finished.copy()
    status, body = run(engine_loop, scenario)
    assert status == 400 and body["error"]["param"] == param, body
    assert param.split(".")[0].split("[")[0] in body["error"]["message"]
    assert engine_loop.engine.counters.requests_finished == admitted and not engine_loop.engine.requests


def test_vllm_flags_beside_a_constraint_are_taken():
    """vLLM's ``disable_*`` flags and ``whitespace_pattern`` are StructuredOutputsParams fields:
    taken (and ignored) beside the constraint, not refused as unknown keys."""
    from llmd.daemon.serving.structured import parse_structured

    so = {"regex": "a+", "disable_any_whitespace": True, "disable_fallback": False,
          "disable_additional_properties": True, "whitespace_pattern": None}
    spec, calling = parse_structured({"structured_outputs": so}, chat=False)
    assert (spec.kind, spec.value, spec.param, calling) == ("regex", "a+", "structured_outputs.regex", None)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "strict": True,
                                                 "schema": {"type": "object"}}}
    assert parse_structured({"response_format": rf}, chat=True)[0].kind == "json"


def test_tools_on_completions_are_refused(engine_loop):
    async def scenario(client):
        resp = await client.post("/v1/completions", json={"prompt": "Hi", "tools": TOOLS, "tool_choice": "required"})
        return resp.status, await resp.json()

    status, body = run(engine_loop, scenario)
    assert status == 400 and body["error"]["param"] == "tools"


def test_openai_sdk_parse_and_tool_call_over_the_socket(engine_loop):
    """The official ``openai`` SDK over a Unix socket (its httpx transport with ``uds``):
    ``chat.completions.parse`` with a pydantic model (OpenAI's strict json_schema) returns a
    parsed object, and a named tool call comes back as ``tool_calls``."""
    openai = pytest.importorskip("openai")
    base = openai._base_client
    httpx = getattr(base, "httpx", None) or getattr(base, "httpx2")  # httpx, or the fork this SDK is built on
    from aiohttp import web
    from pydantic import BaseModel

    from llmd.daemon.serving.api import ServerState

    class Rating(BaseModel):
        color: str
        score: int

    sock = os.path.join(tempfile.mkdtemp(prefix="llmd", dir="/tmp"), "s.sock")  # short: AF_UNIX's 107 bytes

    async def main():
        eng = engine_loop.engine
        state = ServerState(engine_loop=engine_loop, model_id="smollm2-135m", model_ids=("smollm2-135m",),
                            vocab_size=eng.model_config.vocab_size, max_model_len=eng.max_model_len,
                            shutdown=asyncio.Event())
        runner = web.AppRunner(make_app(state), handler_cancellation=True)
        await runner.setup()
        await web.UnixSite(runner, sock).start()
        try:
            client = openai.AsyncOpenAI(base_url="http://llmd/v1", api_key="unused", max_retries=0,
                                        http_client=httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=sock)))
            msgs = [{"role": "user", "content": "Rate the colour of the sky."}]
            parsed = await client.chat.completions.parse(model="smollm2-135m", messages=msgs, response_format=Rating,
                                                         max_tokens=48, temperature=0)
            called = await client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=48, temperature=0)
            await client.close()
            return parsed, called
        finally:
            await runner.cleanup()

    try:
        parsed, called = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        shutil.rmtree(os.path.dirname(sock), ignore_errors=True)
    assert isinstance(parsed.choices[0].message.parsed, Rating)
    call = called.choices[0].message.tool_calls[0]
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
