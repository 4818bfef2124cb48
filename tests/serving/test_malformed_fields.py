"""Malformed request fields found by probing a live daemon as an OpenAI / vLLM client would:
each is a 400 whose ``param`` names the field, never a 500 (in-process app, tiny engine)."""

from __future__ import annotations

import pytest
from app_harness import run_app

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("function", ["get_weather", None, ["get_weather"], 5, {"name": 5}, {}])
def test_tool_choice_whose_function_is_not_an_object_with_a_name_is_400(engine_loop, function):
    """``tool_choice: {"type": "function", "function": "get_weather"}`` (the name without its
    object, as some clients send it) raised AttributeError in the parser: a 500."""

    async def scenario(client):
        resp = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": function}})
        return resp.status, await resp.json()

    status, body = run_app(engine_loop, scenario, timeout=30)
    assert status == 400 and body["error"]["param"] == "tool_choice", body
    assert "tool_choice must be" in body["error"]["message"]


BIG = "1" + "0" * 400  # a JSON integer past float's range: Python decodes it to an int


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": -1e400}', "temperature"),
    ("/detokenize", '{"tokens": [1, 1e400]}', "tokens"),
])
def test_a_number_past_floats_range_is_quoted_as_written(engine_loop, path, raw, param):
    """``1e400`` decodes to infinity; the 400 quotes the number as the client wrote it, not as
    ``Infinity`` (not JSON)."""
    written = raw.split(": ")[-1].strip("[]}").split(", ")[-1]

    async def scenario(client):
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        return resp.status, await resp.json()

    status, body = run_app(engine_loop, scenario, timeout=30)
    assert status == 400 and body["error"]["param"] == param, body
    assert written in body["error"]["message"] and "Infinity" not in body["error"]["message"], body


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                                   "presence_penalty", "length_penalty", "logit_bias"])
def test_a_number_field_holding_an_integer_past_floats_range_is_400(engine_loop, field):
    """``"temperature": 1000…0`` (401 digits) made ``math.isfinite`` raise OverflowError: a 500."""
    value = f'{{"1": {BIG}}}' if field == "logit_bias" else BIG
    raw = f'{{"prompt": "hi", "max_tokens": 2, "{field}": {value}}}'

    async def scenario(client):
        resp = await client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        return resp.status, await resp.json()

    status, body = run_app(engine_loop, scenario, timeout=30)
    assert status == 400 and body["error"]["param"] == field, body
    assert "must be" in body["error"]["message"] and "100000" in body["error"]["message"]


@pytest.mark.parametrize("message, field", [
    ({"role": "user", "content": "hi", "name": 5}, "name"),
    ({"role": "system", "content": "hi", "name": ["bot"]}, "name"),
    ({"role": "tool", "content": "22 C", "tool_call_id": 7}, "tool_call_id"),
    ({"role": "assistant", "content": "no", "refusal": {"why": 1}}, "refusal"),
])
def test_a_message_field_openai_types_as_a_string_holding_another_type_is_400(engine_loop, message, field):
    """``messages[i].name`` (and a tool message's ``tool_call_id``, an assistant's ``refusal``)
    holding a number, array or object was accepted and ignored; OpenAI and vLLM refuse it.
    Chat, its render and /tokenize parse messages alike; a string or null is still accepted."""
    ok = {**message, field: None}, {**message, field: "x"}

    async def scenario(client):
        out = []
        for path in ("/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"):
            resp = await client.post(path, json={"messages": [{"role": "user", "content": "q"}, message],
                                                 "max_tokens": 2})
            out.append((resp.status, await resp.json()))
        for m in ok:
            resp = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "q"}, m]})
            out.append((resp.status, await resp.json()))
        return out

    *bad, good_null, good_str = run_app(engine_loop, scenario, timeout=30)
    for status, body in bad:
        assert status == 400 and body["error"]["param"] == f"messages[1].{field}", body
        assert f"messages[1].{field} must be a string, got" in body["error"]["message"], body
    assert good_null[0] == 200 and good_str[0] == 200, (good_null, good_str)
