"""The rest of the OpenAI surface (issue 17, item 4) on the in-process app with the tiny engine
(byte tokenizer, greedy runs always reach ``max_tokens``): a list of prompts (choices
``i·n + j``, usage summed, streamed with continuous usage), ``echo``, ``logit_bias``, the
fields accepted and refused, an engine error or a disconnect freeing every prompt, and the
official ``openai`` SDK over a Unix socket (404 ``NotFoundError``, a multi-prompt call)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import pytest
from aiohttp import web
from app_harness import run_app, sse_events, state_of

from llmd.daemon.core.faults import FaultInjector
from llmd.daemon.serving.api import make_app


def run(engine_loop, scenario, timeout=60.0):
    return run_app(engine_loop, scenario, timeout=timeout)


events = sse_events


async def post(client, body, path="/v1/completions"):
    resp = await client.post(path, json=body)
    return resp.status, await resp.json()


def finished(engine_loop, reason: str) -> int:
    return engine_loop.snapshot()["counters"]["requests_finished"][reason]


async def idle(engine_loop, timeout=30.0) -> None:
    """Wait until the engine holds no request and the published snapshot has caught up."""
    end = time.monotonic() + timeout
    while engine_loop.engine.requests or engine_loop.snapshot()["scheduler"]["running"]:
        assert time.monotonic() < end, "requests left live"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # the snapshot is rebuilt at most every 0.1 s


PROMPTS = ["hello", [104, 105], "abc"]
GREEDY = {"max_tokens": 5, "temperature": 0}


def test_prompt_list_one_choice_per_prompt_and_sample_usage_summed_streamed_with_continuous_usage(engine_loop):
    """prompt = [text, token ids, text], n = 2: 6 choices, index i·n + j, prompt i's choices equal
    its solo reply; usage sums every prompt once; the stream (include_usage +
    continuous_usage_stats) joins to the same texts per index, each chunk's usage is its own
    choice's so far, the last chunk the sum."""

    async def scenario(client):
        solo = [await post(client, {"prompt": p, **GREEDY}) for p in PROMPTS]
        full = await post(client, {"prompt": PROMPTS, "n": 2, **GREEDY})
        resp = await client.post("/v1/completions", json={"prompt": PROMPTS, "n": 2, **GREEDY, "stream": True,
                                                          "stream_options": {"include_usage": True,
                                                                             "continuous_usage_stats": True}})
        return solo, full, await events(resp)

    solo, (status, full), evs = run(engine_loop, scenario)
    assert status == 200 and [c["index"] for c in full["choices"]] == list(range(6))
    for i, (_, one) in enumerate(solo):
        assert [c["text"] for c in full["choices"][2 * i:2 * i + 2]] == [one["choices"][0]["text"]] * 2
    assert full["usage"] == {"prompt_tokens": 5 + 2 + 3, "completion_tokens": 30, "total_tokens": 40,
                             "prompt_tokens_details": {"cached_tokens": full["usage"]["prompt_tokens_details"][
                                 "cached_tokens"]}}
    assert evs[-1] == "[DONE]" and evs[-2]["choices"] == [] and evs[-2]["usage"]["total_tokens"] == 40
    texts, last = {}, {}
    for ev in evs[:-2]:
        (ch,) = ev["choices"]
        i = ch["index"]
        texts[i] = texts.get(i, "") + ch["text"]
        u = ev["usage"]
        assert u["prompt_tokens"] == [5, 2, 3][i // 2] and u["total_tokens"] == u["prompt_tokens"] + u[
            "completion_tokens"]
        assert u["completion_tokens"] >= last.get(i, 0)
        last[i] = u["completion_tokens"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]} and set(last.values()) == {5}


def test_echo_prepends_the_prompt_and_refuses_logprobs(engine_loop):
    """echo: the prompt's text (token ids decoded) before each choice's text; streamed, each
    choice's first chunk is its prompt; echo with logprobs and echo on chat are 400s naming echo."""

    async def scenario(client):
        plain = await post(client, {"prompt": PROMPTS[:2], **GREEDY})
        echoed = await post(client, {"prompt": PROMPTS[:2], "echo": True, **GREEDY})
        resp = await client.post("/v1/completions", json={"prompt": "hello", "echo": True, "stream": True, **GREEDY})
        bad = [await post(client, {"prompt": "hello", "echo": True, "logprobs": 1, **GREEDY}),
               await post(client, {"messages": [{"role": "user", "content": "hi"}], "echo": True, **GREEDY},
                          "/v1/chat/completions")]
        return plain, echoed, await events(resp), bad

    (_, plain), (status, echoed), evs, bad = run(engine_loop, scenario)
    assert status == 200
    assert [c["text"] for c in echoed["choices"]] == ["hello" + plain["choices"][0]["text"],
                                                      "hi" + plain["choices"][1]["text"]]
    assert evs[0]["choices"][0]["text"] == "hello" and evs[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == echoed["choices"][0]["text"]
    for s, err in bad:
        assert s == 400 and err["error"]["param"] == "echo", err
    assert "logprobs" in bad[0][1]["error"]["message"]


def test_completion_top_logprobs_hold_the_sampled_token_first(engine_loop):
    """Completions' ``top_logprobs`` entries start with the sampled token (OpenAI legacy, vLLM),
    so ``logprobs: 0`` gives the sampled token alone, streamed or not; ``logprobs: 2`` gives it
    and up to 2 more, the top ones in order."""

    async def scenario(client):
        sampled = {"prompt": "hello", "max_tokens": 6, "temperature": 1.5, "seed": 5}
        zero = await post(client, {**sampled, "logprobs": 0})
        two = await post(client, {**sampled, "logprobs": 2})
        resp = await client.post("/v1/completions", json={**sampled, "logprobs": 0, "stream": True})
        return zero, two, await events(resp)

    (s0, zero), (s2, two), evs = run(engine_loop, scenario)
    assert s0 == s2 == 200
    lp0, lp2 = zero["choices"][0]["logprobs"], two["choices"][0]["logprobs"]
    assert lp0["top_logprobs"] == [{t: v} for t, v in zip(lp0["tokens"], lp0["token_logprobs"])]
    streamed = [top for e in evs[:-1] for c in e["choices"] if c["logprobs"] for top in c["logprobs"]["top_logprobs"]]
    assert streamed == lp0["top_logprobs"]
    assert lp2["tokens"] == lp0["tokens"]  # same seed, same draws
    for tok, v, top in zip(lp2["tokens"], lp2["token_logprobs"], lp2["top_logprobs"]):
        assert next(iter(top.items())) == (tok, v) and 2 <= len(top) <= 3
        others = list(top.values())[1:]  # the top 2 but the sampled token, best first
        assert others == sorted(others, reverse=True)
    assert any(len(top) == 3 for top in lp2["top_logprobs"]), "temperature 1.5 never left the top 2"


def test_logit_bias_steers_its_request_only_and_logprobs_stay_raw(engine_loop):
    """logit_bias {"65": 100} makes greedy pick 'A' every step, while a concurrent request without
    it gets its solo reply; the reported logprob of 'A' is the raw model's (far from 0)."""

    async def scenario(client):
        solo = await post(client, {"prompt": "hello", **GREEDY})
        both = await asyncio.gather(post(client, {"prompt": "hello", "logit_bias": {"65": 100}, "logprobs": 0,
                                                  **GREEDY}),
                                    post(client, {"prompt": "hello", **GREEDY}))
        return solo, both

    (_, solo), ((s1, biased), (_, other)) = run(engine_loop, scenario)
    assert s1 == 200 and biased["choices"][0]["text"] == "AAAAA"
    assert max(biased["choices"][0]["logprobs"]["token_logprobs"]) < -1.0  # raw: a random 256-token model
    assert other["choices"][0]["text"] == solo["choices"][0]["text"] != "AAAAA"


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"suffix": " end"}, "suffix"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"web_search_options": {}}, None),  # empty: accepted
    ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("/v1/completions", {"stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
])
def test_fields_llmd_cannot_honour_are_400s_naming_them(engine_loop, path, extra, param):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}

    async def scenario(client):
        return await post(client, {**body, "max_tokens": 2, **extra}, path)

    status, out = run(engine_loop, scenario)
    assert (status, out.get("error", {}).get("param")) == ((200, None) if param is None else (400, param)), out


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "hi", "min_tokens": -5}, "min_tokens", "integer in [0, inf], got -5"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": "3"}, "min_tokens", 'got string "3"'),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 3}, "min_tokens", "min_tokens (3) must be <= max_tokens (2)"),
    ("/v1/completions/render", {"prompt": "hi", "min_tokens": 3}, "min_tokens", "must be <= max_tokens (2)"),
    ("/v1/completions", {"prompt": ["Hi", 5]}, "prompt", "with number 5"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content", "messages[0].content[0].text must be a string, got number 5"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", 'messages[0].content[1] must be a text part'),
])
def test_bad_values_name_the_element(engine_loop, path, body, param, words):
    """Found by a user: a negative ``min_tokens`` was accepted (it is now applied, in vLLM's range),
    a mixed prompt list blamed its good element, and a text part's non-string ``text`` got the
    image message."""
    async def scenario(client):
        return await post(client, {**body, "max_tokens": 2}, path)

    status, out = run(engine_loop, scenario)
    assert (status, out["error"]["param"]) == (400, param), out
    assert words in out["error"]["message"], out


def test_harmless_fields_routers_add_are_accepted(engine_loop):
    """user, metadata, store, service_tier, safety_identifier, prompt_cache_key, min_tokens 1 (applied:
    the reply's first token is not EOS anyway), skip_special_tokens: true, echo: false,
    modalities ["text"]: the same reply as without them."""
    extra = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "safety_identifier": "s",
             "prompt_cache_key": "k", "min_tokens": 1, "skip_special_tokens": True, "echo": False}

    async def scenario(client):
        chat = {"messages": [{"role": "user", "content": "hi"}], **GREEDY}
        return [await post(client, {"prompt": "hi", **GREEDY}), await post(client, {"prompt": "hi", **GREEDY, **extra}),
                await post(client, chat, "/v1/chat/completions"),
                await post(client, {**chat, **extra, "modalities": ["text"]}, "/v1/chat/completions")]

    (s0, a), (s1, b), (s2, c), (s3, d) = run(engine_loop, scenario)
    assert (s0, s1, s2, s3) == (200, 200, 200, 200), (b, d)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert c["choices"][0]["message"] == d["choices"][0]["message"]


def test_engine_error_in_a_batch_is_500_and_a_disconnect_aborts_every_prompt(engine_loop):
    """A postprocessing fault in prompt 0 (n = 4 fills the 4 running slots, prompt 1 waits): 500
    and prompt 1's sequences are aborted, not left to run; a client leaving a 3-prompt stream
    aborts all 3."""
    eng = engine_loop.engine
    FaultInjector.parse("postprocess:31@5").install(eng)

    async def scenario(client):
        a0, e0 = finished(engine_loop, "abort"), finished(engine_loop, "error")
        failed = await post(client, {"prompt": ["hello", "abc"], "n": 4, "max_tokens": 400, "seed": 31,
                                     "temperature": 0})
        await idle(engine_loop)
        counts = finished(engine_loop, "abort") - a0, finished(engine_loop, "error") - e0
        resp = await client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 400, "temperature": 0,
                                                          "stream": True})
        await resp.content.readline()
        resp.close()
        await idle(engine_loop)
        return failed, counts, finished(engine_loop, "abort") - a0 - counts[0]

    try:
        (status, err), (aborted, errors), left = run(engine_loop, scenario)
    finally:
        eng.faults = None
    assert status == 500 and err["error"]["type"] == "server_error", err
    assert errors >= 1 and aborted + errors == 8 and aborted >= 4  # prompt 1's 4 never ran to length
    assert left == 3


def test_openai_sdk_404_model_not_found_and_a_multi_prompt_call_over_the_socket(engine_loop):
    """The official SDK over a Unix socket: an unknown model raises NotFoundError (404,
    ``code: model_not_found``) on both endpoints; ``completions.create`` with two prompts and
    n = 2 returns 4 choices in index order, usage summed; ``logit_bias`` is sent and applied."""
    openai = pytest.importorskip("openai")
    base = openai._base_client
    httpx = getattr(base, "httpx", None) or getattr(base, "httpx2")  # httpx, or the fork this SDK is built on
    sock = os.path.join(tempfile.mkdtemp(prefix="llmd", dir="/tmp"), "s.sock")  # short: AF_UNIX's 107 bytes

    async def main():
        runner = web.AppRunner(make_app(state_of(engine_loop)), handler_cancellation=True)
        await runner.setup()
        await web.UnixSite(runner, sock).start()
        try:
            client = openai.AsyncOpenAI(base_url="http://llmd/v1", api_key="unused", max_retries=0,
                                        http_client=httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=sock)))
            missing = []
            for call in (lambda: client.completions.create(model="nope", prompt="hi", max_tokens=2),
                         lambda: client.chat.completions.create(model="nope", max_tokens=2,
                                                                messages=[{"role": "user", "content": "hi"}])):
                with pytest.raises(openai.NotFoundError) as ei:
                    await call()
                missing.append(ei.value)
            multi = await client.completions.create(model="tiny", prompt=["hello", "abc"], n=2, max_tokens=3,
                                                    temperature=0, user="u", logit_bias={"66": 100})
            await client.close()
            return missing, multi
        finally:
            await runner.cleanup()

    try:
        missing, multi = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        shutil.rmtree(os.path.dirname(sock), ignore_errors=True)
    assert all(e.status_code == 404 and e.code == "model_not_found" and e.param == "model" for e in missing)
    assert [c.index for c in multi.choices] == [0, 1, 2, 3] and [c.text for c in multi.choices] == ["BBB"] * 4
    assert (multi.usage.prompt_tokens, multi.usage.completion_tokens) == (5 + 3, 12)
