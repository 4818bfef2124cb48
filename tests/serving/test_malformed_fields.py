"""Malformed request fields found by probing a live daemon as an OpenAI / vLLM client would:
each is a 400 whose ``param`` names the field, never a 500 (in-process app, tiny engine)."""

from __future__ import annotations

import pytest
from app_harness import run_app, start_loop

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def engine_loop(tmp_path_factory):
    loop = start_loop(tmp_path_factory, max_num_seqs=4)
    yield loop
    loop.stop()
    assert loop.engine.kv_manager.num_used_blocks == 0 and not loop.engine.requests


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
