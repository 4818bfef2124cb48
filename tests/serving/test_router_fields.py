"""What vllm-router sends a worker, in-process (the tiny engine's app, aiohttp's test client):
the bodies 0.1.17 forwards (recorded from a logging worker) are answered as the client's own
body would be, the router fields that would change the reply are refused when set, and vLLM's
render endpoints (``daemon/serving/render.py``) return the ids generation prefills, queueing
nothing. The real router in front of two workers: ``tests/e2e/test_vllm_router.py``."""

from __future__ import annotations

import pytest
from app_harness import run_app, sse_events, start_loop

#: the router's additions to a completions body (vllm-router 0.1.17, plain mode)
ROUTER_COMPLETION = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                     "skip_special_tokens": True, "return_hidden_states": False}
#: ... and to a chat body
ROUTER_CHAT = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def engine_loop(tmp_path_factory):
    loop = start_loop(tmp_path_factory, max_num_seqs=2)
    yield loop
    loop.stop()


def test_router_bodies_answer_as_the_clients_own(engine_loop):
    plain = {"prompt": "hello", "max_tokens": 5, "temperature": 0}
    chat = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0}

    async def scenario(c):
        out = []
        for path, body, extra in (("/v1/completions", plain, ROUTER_COMPLETION), ("/v1/chat/completions", chat,
                                                                                  ROUTER_CHAT)):
            own, routed = await c.post(path, json=body), await c.post(path, json={**body, **extra})
            assert own.status == routed.status == 200, await routed.text()
            out.append(((await own.json())["choices"][0], (await routed.json())["choices"][0]))
        stream = await c.post("/v1/chat/completions", json={**chat, **ROUTER_CHAT, "stream": True})
        events = await sse_events(stream)
        return out, events

    (completion, chat_reply), events = run_app(engine_loop, scenario)
    assert completion[0]["text"] == completion[1]["text"] and len(completion[0]["text"]) == 5
    assert chat_reply[0]["message"] == chat_reply[1]["message"]
    streamed = "".join(ch["delta"].get("content") or "" for e in events[:-1] for ch in e["choices"])
    assert events[-1] == "[DONE]" and streamed == chat_reply[0]["message"]["content"]


@pytest.mark.parametrize("path,field", [("/v1/completions", "return_hidden_states"),
                                        ("/v1/completions", "no_stop_trim"),
                                        ("/v1/chat/completions", "no_stop_trim"),
                                        ("/v1/chat/completions", "return_hidden_states"),
                                        ("/v1/chat/completions", "continue_final_message")])
def test_router_fields_that_would_change_the_reply_are_refused_when_set(engine_loop, path, field):
    body = {"prompt": "hello"} if "chat" not in path else {"messages": MESSAGES}

    async def scenario(c):
        resp = await c.post(path, json={**body, "max_tokens": 2, field: True})
        return resp.status, await resp.json()

    status, err = run_app(engine_loop, scenario)
    assert status == 400 and err["error"]["param"] == field, err


def test_render_returns_the_ids_generation_prefills_and_queues_nothing(engine_loop):
    async def scenario(c):
        post = lambda path, body: c.post(path, json=body)  # noqa: E731
        before = await (await c.get("/v1/stats")).json()
        one = await (await post("/v1/completions/render", {"prompt": "hello", "max_tokens": 3, "temperature": 0.5,
                                                           "stop": ["x"], **ROUTER_COMPLETION, "min_tokens": 2})).json()
        tok = await (await post("/tokenize", {"prompt": "hello"})).json()
        many = await (await post("/v1/completions/render", {"prompt": ["ab", [7, 8, 9]]})).json()
        chat = await (await post("/v1/chat/completions/render", {
            "messages": MESSAGES, "seed": 5, **ROUTER_CHAT, "stream": True,
            "stream_options": {"include_usage": True}})).json()
        chat_tok = await (await c.post("/tokenize", json={"messages": MESSAGES})).json()
        after = await (await c.get("/v1/stats")).json()
        gen = await (await c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})).json()
        return before, one, tok, many, chat, chat_tok, after, gen

    before, one, tok, many, chat, chat_tok, after, gen = run_app(engine_loop, scenario)
    assert isinstance(one, list) and len(one) == 1 and one[0]["token_ids"] == tok["tokens"] == list(b"hello")
    first = one[0]
    assert first["request_id"].startswith("cmpl-") and first["model"] == "tiny" and first["features"] is None
    assert first["kv_transfer_params"] is None and first["stream"] is False and first["stream_options"] is None
    sp = first["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["stop"], sp["n"], sp["seed"], sp["min_tokens"]) == \
        (3, 0.5, ["x"], 1, None, 2)
    assert [r["token_ids"] for r in many] == [list(b"ab"), [7, 8, 9]]
    assert many[0]["sampling_params"]["max_tokens"] == 512 - 2  # omitted: the remaining context
    assert isinstance(chat, dict) and chat["token_ids"] == chat_tok["tokens"]
    assert chat["request_id"].startswith("chatcmpl-") and chat["sampling_params"]["seed"] == 5
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert gen["usage"]["prompt_tokens"] == len(chat["token_ids"])  # what the generation prefilled
    assert after["counters"]["prompt_tokens"] == before["counters"]["prompt_tokens"]  # nothing ran
    assert sum(after["counters"]["requests_finished"].values()) == sum(before["counters"]["requests_finished"].values())


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions/render", {"prompt": "hi", "model": "other"}, 404, "model"),
    ("/v1/completions/render", {"prompt": "x" * 500, "max_tokens": 20}, 400, "max_tokens"),
    ("/v1/completions/render", {"prompt": list(range(3)) * 200}, 400, "prompt"),
    ("/v1/completions/render", {"prompt": "hi", "return_token_offsets": True}, 400, "return_token_offsets"),
    ("/v1/completions/render", {"prompt": "hi", "temperature": 9}, 400, "temperature"),
    ("/v1/chat/completions/render", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions/render", {"messages": MESSAGES, "continue_final_message": True}, 400,
     "continue_final_message"),
])
def test_render_refuses_what_generation_refuses(engine_loop, path, body, status, param):
    async def scenario(c):
        resp = await c.post(path, json=body)
        return resp.status, await resp.json()

    got, err = run_app(engine_loop, scenario)
    assert got == status and err["error"]["param"] == param, err
