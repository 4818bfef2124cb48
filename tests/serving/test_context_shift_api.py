"""Context shift over HTTP (case A6 per mode): a tiny engine with a 64-token context under the
default ``--context-overflow stop``, and requests that opt in with ``context_overflow``."""

from __future__ import annotations

import pytest
from app_harness import run_app, sse_events, start_loop

PROMPT = "You are terse. Tell me about the sea"  # 36 byte tokens


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    lp = start_loop(tmp_path_factory, max_model_len=64, keep=10)
    yield lp
    lp.stop()


def _body(**kw):
    return {"model": "tiny", "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **kw}


def test_a6_per_mode(loop):
    """stop: 36 + max_tokens 100 > 64 is a 400 naming max_tokens, 36 + 28 = 64 is a 200; shift:
    36 + 100 is a 200 with 100 completion tokens, the prompt counted as sent; a 100-token
    prompt is a 400 in both modes unless truncate_prompt_tokens opts in."""

    async def go(client):
        r = await client.post("/v1/completions", json=_body(max_tokens=100))
        assert r.status == 400 and (await r.json())["error"]["param"] == "max_tokens"
        r = await client.post("/v1/completions", json=_body(max_tokens=28))
        assert r.status == 200
        r = await client.post("/v1/completions", json=_body(max_tokens=100, context_overflow="shift"))
        body = await r.json()
        assert r.status == 200, body
        usage = body["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (36, 100, 136)
        assert body["choices"][0]["finish_reason"] == "length"
        stream = await client.post("/v1/completions", json=_body(max_tokens=100, context_overflow="shift",
                                                                   stream=True))
        text = "".join(e["choices"][0]["text"] for e in await sse_events(stream) if e != "[DONE]" and e["choices"])
        assert text == body["choices"][0]["text"]
        for overflow in ("stop", "shift"):
            r = await client.post("/v1/completions", json=_body(prompt="x" * 100, max_tokens=4,
                                                                context_overflow=overflow))
            assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
            r = await client.post("/v1/completions", json=_body(prompt="x" * 100, max_tokens=4,
                                                                context_overflow=overflow, truncate_prompt_tokens=50))
            assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == 50
            ids = [120] * 100  # a token-id prompt truncates the same way
            r = await client.post("/v1/completions", json=_body(prompt=ids, max_tokens=4, context_overflow=overflow))
            assert r.status == 400 and "truncate_prompt_tokens" in (await r.json())["error"]["message"]
            r = await client.post("/v1/completions", json=_body(prompt=ids, max_tokens=1, context_overflow=overflow,
                                                                truncate_prompt_tokens=-1))  # room for one token
            assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == 63

    run_app(loop, go)


@pytest.mark.parametrize("extra,param", [
    ({"context_overflow": "wrap"}, "context_overflow"),
    ({"n_keep": "all"}, "n_keep"),
    ({"n_keep": -2}, "n_keep"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 64}, "truncate_prompt_tokens"),
    ({"context_overflow": "shift", "use_beam_search": True, "n": 2}, "context_overflow"),
])
def test_bad_fields_are_400s_naming_them(loop, extra, param):
    async def go(client):
        r = await client.post("/v1/completions", json=_body(max_tokens=4, **extra))
        assert r.status == 400 and (await r.json())["error"]["param"] == param

    run_app(loop, go)
