"""Admission limits at the API edge: a full waiting queue is HTTP 429 with Retry-After (and the
engine keeps serving), priorities and cache salts are validated, and the server's stats carry
the preemption counters."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tiny_engine import tiny_engine

from llmd.daemon.core.errors import LlmdError, ServerBusyError
from llmd.daemon.core.request import SamplingParams
from llmd.daemon.serving.api import ServerState, engine_error, make_app
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.validation import ApiError, parse_request


def test_full_waiting_queue_is_429_and_the_engine_keeps_serving(make_engine):
    engine = make_engine(max_num_waiting=2, max_num_seqs=1)
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request([100, 101, 102], sp)
    engine.add_request([103, 104, 105], sp)
    with pytest.raises(ServerBusyError, match="waiting queue is full") as ei:
        engine.add_request([106, 107], sp)
    err = engine_error(ei.value)
    assert err.status == 429 and err.headers == {"Retry-After": "1"}
    assert engine_error(LlmdError("prompt too long")).status == 400
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert len(done) == 2 and engine.kv_manager.num_used_blocks == 0
    engine.add_request([106, 107], sp)  # room again


def test_priority_and_cache_salt_fields():
    p = parse_request({"prompt": "hi", "priority": -3, "cache_salt": "tenant-a"}, False, ["m"], 1000)
    assert p.priority == -3 and p.cache_salt == "tenant-a"
    assert parse_request({"prompt": "hi"}, False, ["m"], 1000).priority == 0
    for bad in ({"priority": "high"}, {"priority": 1.5}, {"cache_salt": ""}, {"cache_salt": 7}):
        with pytest.raises(ApiError) as ei:
            parse_request({"prompt": "hi", **bad}, False, ["m"], 1000)
        assert ei.value.status == 400 and ei.value.param in ("priority", "cache_salt")
    for salt, got in (("", 'got string ""'), (7, "got number 7"), ("x" * 1025, "got a string of 1025 characters")):
        with pytest.raises(ApiError) as ei:
            parse_request({"prompt": "hi", "cache_salt": salt}, False, ["m"], 1000)
        assert ei.value.message.endswith(got), ei.value.message


def test_stats_carry_groups_prefix_and_preemption_fields(llmd_daemon):
    st = llmd_daemon.client().stats()
    kv = st["kv_cache"]
    assert kv["groups"][0]["name"] == "full_attention" and kv["groups"][0]["sliding_window"] is None
    assert kv["bytes_per_token"] == 46080 and kv["memory_bytes"] == kv["num_blocks"] * 16 * 46080
    assert kv["used"] + kv["free"] + kv["cached_free"] == kv["total"]
    assert set(st["prefix_cache"]) >= {"queries", "hits", "enabled", "evictions"} and st["prefix_cache"]["enabled"]
    assert "num_preemptions" in st["counters"] and "preempted" in st["scheduler"]


def test_lone_surrogates_are_400_not_500():
    """JSON allows "\\ud800"; it is not encodable text: a 400 naming the field, before the engine."""
    for body, field in (({"prompt": "a\ud800b"}, "prompt"), ({"prompt": "hi", "cache_salt": "\ud800"}, "cache_salt")):
        with pytest.raises(ApiError) as ei:
            parse_request(body, False, ["m"], 1000)
        assert ei.value.status == 400 and ei.value.param == field
    with pytest.raises(ApiError) as ei:
        parse_request({"messages": [{"role": "user", "content": "\udfff"}]}, True, ["m"], 1000)
    assert ei.value.param == "messages[0].content"


def test_oversized_text_is_rejected_before_tokenizing():
    from llmd.daemon.core.input_processor import MAX_CHARS_PER_TOKEN
    from llmd.daemon.serving.api import check_size

    check_size("x" * (MAX_CHARS_PER_TOKEN * 100), 100, chat=False)  # at the limit: left to the tokenizer
    with pytest.raises(ApiError, match="characters") as ei:
        check_size("x" * (MAX_CHARS_PER_TOKEN * 100 + 1), 100, chat=False)
    assert ei.value.status == 400 and ei.value.param == "prompt"
    with pytest.raises(ApiError) as ei:
        check_size([{"role": "user", "content": "y" * 7000}], 100, chat=True)
    assert ei.value.param == "messages"


def test_engine_rejections_name_the_endpoints_prompt_field():
    """A chat request the engine rejects (no chat template, prompt too long) names ``messages``;
    a completion names ``prompt``; a max_tokens problem names ``max_tokens``: the field travels
    in the error (``RequestError.param``), never guessed from its message."""
    from llmd.daemon.core.errors import LlmdError, RequestError
    from llmd.daemon.serving.api import engine_error

    e = LlmdError("the chat template of gemma3-270m refused the messages: roles must alternate")
    assert engine_error(e, chat=True).param == "messages"
    assert engine_error(e, chat=False).param == "prompt"
    too_long = RequestError("prompt has 9000 tokens but the context is 8192 tokens", "prompt")
    assert engine_error(too_long, chat=True).param == "messages"
    assert engine_error(RequestError("prompt (10 tokens) + max_tokens (9000) = 9010 exceeds", "max_tokens"),
                        chat=True).param == "max_tokens"
    assert engine_error(RequestError("the message names max_tokens", None), chat=False).param == "prompt"


def test_deeply_nested_json_is_400_and_type_names_are_json_names():
    """JSON nested past Python's recursion limit is a 400 (not a 500 from RecursionError), and
    type errors name JSON types (null, number, ...), not Python's."""
    import asyncio

    from llmd.daemon.serving.api import read_json

    class FakeRequest:
        def __init__(self, raw: bytes):
            self.raw = raw

        async def read(self):
            return self.raw

    deep = b'{"prompt": "x", "z": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ApiError, match="nested too deeply") as ei:
        asyncio.run(read_json(FakeRequest(deep)))
    assert ei.value.status == 400
    assert asyncio.run(read_json(FakeRequest(b'{"prompt": "x"}'))) == {"prompt": "x"}
    with pytest.raises(ApiError, match="got null"):
        parse_request({"messages": [{"role": "user", "content": None}]}, True, ["m"], 1000)
    with pytest.raises(ApiError, match="got number"):
        parse_request({"prompt": 3.5}, False, ["m"], 1000)
    with pytest.raises(ApiError, match="got array"):
        parse_request([1], False, ["m"], 1000)
    # a scalar of the wrong type is quoted as the client wrote it
    with pytest.raises(ApiError, match='^stream_options.include_usage must be a boolean, got string "yes"$'):
        parse_request({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, False, ["m"], 1000)
    with pytest.raises(ApiError, match="got number 3.5"):
        parse_request({"prompt": 3.5}, False, ["m"], 1000)


def test_priority_is_a_400_unless_the_daemon_schedules_by_priority(tmp_path):
    """vLLM's --scheduling-policy: under "fcfs" (the default) a non-zero ``priority`` is a 400
    naming it, nothing queued; under "priority" it is served. Through the HTTP app on a tiny engine."""
    async def post(loop, body):
        eng = loop.engine
        state = ServerState(engine_loop=loop, model_id="tiny", model_ids=("tiny",),
                            vocab_size=eng.model_config.vocab_size, max_model_len=eng.max_model_len,
                            shutdown=asyncio.Event())
        async with TestClient(TestServer(make_app(state))) as client:
            resp = await client.post("/v1/completions", json=body)
            return resp.status, await resp.json()

    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "priority": 3}
    for policy in ("fcfs", "priority"):
        loop = EngineLoop(tiny_engine(tmp_path / f"{policy}.gguf", scheduling_policy=policy), "tiny").start()
        try:
            status, out = asyncio.run(post(loop, body))
            assert loop.engine.kv_manager.num_used_blocks == 0
        finally:
            loop.stop()
        if policy == "fcfs":
            assert status == 400 and out["error"]["param"] == "priority", out
            assert "--scheduling-policy priority" in out["error"]["message"]
        else:
            assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
    with pytest.raises(LlmdError, match="--scheduling-policy must be one of fcfs, priority"):
        tiny_engine(tmp_path / "bad.gguf", scheduling_policy="lifo")


@pytest.mark.parametrize("field,value,quoted", [
    ("max_tokens", True, "got boolean true"), ("temperature", float("nan"), "got NaN"),
    ("stream", None, None), ("stream", "yes", 'got "yes"'), ("logprobs", 1.5, None), ("ignore_eos", 1, "got 1"),
    ("temperature", 9.0, "got 9.0"), ("max_tokens", 0, "got 0"), ("stop", {"a": 1}, 'got {"a": 1}'),
    ("stop", True, "got true"), ("prompt", True, "got boolean true"), ("prompt", [1, "a"], 'got string "a" in it'),
    ("prompt", [1, None], "got null in it"),
])
def test_errors_quote_the_value_in_json_not_python(field, value, quoted):
    """A bad field's 400 quotes what the client sent as JSON spells it (true, null, NaN, "text"),
    never Python's True / None / nan / 'text'."""
    if value is None:  # null is a valid "not given" here: no error
        parse_request({"prompt": "hi", field: value}, False, ["m"], 1000)
        return
    with pytest.raises(ApiError) as ei:
        parse_request({"prompt": "hi", field: value}, False, ["m"], 1000)
    msg = ei.value.message
    assert ei.value.status == 400 and ei.value.param == field
    assert not any(w in msg for w in ("True", "False", "None", "nan", "'")), msg
    if quoted:
        assert quoted in msg, msg


@pytest.mark.parametrize("messages,quoted", [([], "got []"), (None, "got null"), ("hi", 'got "hi"')])
def test_a_bad_messages_field_is_quoted_as_json(messages, quoted):
    with pytest.raises(ApiError) as ei:
        parse_request({"messages": messages}, True, ["m"], 1000)
    assert ei.value.status == 400 and ei.value.param == "messages" and quoted in ei.value.message


def test_an_oversized_body_is_413_naming_the_limit(tmp_path):
    """A body past aiohttp's ``client_max_size`` is a JSON 413 that states the limit (not its bare
    "Request Entity Too Large"), and the next request is served."""
    from llmd.daemon.serving.api import MAX_BODY_BYTES

    async def go(loop):
        eng = loop.engine
        state = ServerState(engine_loop=loop, model_id="tiny", model_ids=("tiny",),
                            vocab_size=eng.model_config.vocab_size, max_model_len=eng.max_model_len,
                            shutdown=asyncio.Event())
        async with TestClient(TestServer(make_app(state))) as client:
            big = await client.post("/v1/completions", data=b"x" * (MAX_BODY_BYTES + 1),
                                    headers={"Content-Type": "application/json"})
            ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            return big.status, await big.json(), ok.status

    loop = EngineLoop(tiny_engine(tmp_path / "t.gguf"), "tiny").start()
    try:
        status, out, ok = asyncio.run(go(loop))
    finally:
        loop.stop()
    assert status == 413 and out["error"]["code"] == 413, out
    assert out["error"]["message"] == f"request body too large: the limit is {MAX_BODY_BYTES // 2**20} MiB"
    assert ok == 200
