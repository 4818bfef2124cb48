"""vLLM's render endpoints: a completion or chat request turned into the token ids generation
would run on, without generating anything.

* ``POST /v1/completions/render`` → a JSON list with one ``GenerateRequest`` per prompt (a
  ``prompt`` list renders every prompt, in order);
* ``POST /v1/chat/completions/render`` → one ``GenerateRequest`` (the chat template applied,
  the assistant turn opened, as generation does).

A ``GenerateRequest`` is vLLM's token-in request body (``vllm/entrypoints/serve/disagg/protocol.py``;
built as in ``vllm/entrypoints/serve/render/serving.py``): ``{"request_id": "cmpl-…" |
"chatcmpl-…", "token_ids": [int], "features": null, "sampling_params": {...}, "model",
"stream", "stream_options", "cache_salt", "priority", "kv_transfer_params": null}``.
``sampling_params`` carries vLLM's names for what the request asked (``n``, ``temperature``,
``top_p``, ``top_k``, ``min_p``, the three penalties, ``seed`` as sent or null, ``stop``,
``stop_token_ids``, ``ignore_eos``, ``max_tokens`` resolved as generation resolves it: the
remaining context when omitted, ``min_tokens``, ``logprobs``, ``logit_bias``, ``skip_special_tokens``).

The body is validated exactly as the generating endpoint validates it (``validation.parse_request``:
the same 400s naming the field, 404 for another ``model``) and tokenized by the same input
processor on the tokenizer pool, with the same length rules (a prompt that leaves no room to
generate, or prompt + ``max_tokens`` over the context, is a 400), so ``token_ids`` are the
ids a generation request with this body would prefill (tested). Nothing is queued: the
engine never sees a render. ``return_token_offsets: true`` (newer vLLM's per-token character
offsets) is refused with a 400 naming it.

Who calls it: vllm-router 0.1.17 with ``--policy cache_aware`` renders every request on every
worker (``Authorization: Bearer`` its own ``--api-key``), and falls back to ``POST /tokenize``
when render answers an error (the README's "Replicas behind vllm-router").
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from aiohttp import web

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.serving.api import STATE, check_size, engine_error, read_json
from llmd.daemon.serving.validation import ApiError, ParsedRequest, parse_request


def sampling_params_body(parsed: ParsedRequest, body: dict, max_tokens: int) -> dict:
    """vLLM's ``SamplingParams`` field names for what ``parsed`` asks (``max_tokens`` resolved;
    ``seed`` as the client sent it, since llmd draws one per request when absent)."""
    p = parsed.params
    return {"n": parsed.n, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
            "repetition_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "seed": body.get("seed"), "stop": list(p.stop),
            "stop_token_ids": sorted(p.stop_token_ids), "ignore_eos": p.ignore_eos, "max_tokens": max_tokens,
            "min_tokens": p.min_tokens,
            "logprobs": p.logprobs, "skip_special_tokens": True,
            "logit_bias": {str(k): v for k, v in p.logit_bias.items()} if p.logit_bias else None}


async def _render(request: web.Request, chat: bool) -> list[dict]:
    """The ``GenerateRequest`` bodies of a completion (``chat=False``) or chat body.

    Raises:
        ApiError: what the generating endpoint would answer for this body (400 / 404 / 429 is
            impossible: nothing is queued), and 400 for ``return_token_offsets: true``.
    """
    st = request.app[STATE]
    body = await read_json(request)
    parsed = parse_request(body, chat, st.model_ids, st.vocab_size, st.max_model_len)
    if body.get("return_token_offsets"):
        raise ApiError("return_token_offsets is not supported by llmd's render endpoints", "return_token_offsets")
    prompts = parsed.prompts or [parsed.prompt]
    for p in prompts:
        check_size(p, st.max_model_len, chat)
    processor = st.engine_loop.engine.input_processor
    out = []
    for prompt in prompts:
        try:
            ids = await asyncio.wrap_future(st.engine_loop.tokenize(prompt))
            # the length rules of admission; max_tokens resolved on a copy (ids: only re-checked)
            params = dataclasses.replace(parsed.params)
            processor.process(ids, params)
            params.validate()  # as Engine.add_request does after process(): min_tokens vs the resolved max_tokens
            if params.structured is not None:  # the constraint's 400s too (compiled and cached, as submit does)
                await asyncio.wrap_future(st.engine_loop.compile_grammar(params.structured))
        except LlmdError as e:
            raise engine_error(e, chat) from None
        out.append({
            "request_id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            "token_ids": ids, "features": None,
            "sampling_params": sampling_params_body(parsed, body, params.max_tokens),
            "model": body.get("model") or st.model_id, "stream": parsed.stream,
            "stream_options": body.get("stream_options") if parsed.stream else None,
            "cache_salt": parsed.cache_salt, "priority": parsed.priority, "kv_transfer_params": None,
        })
    return out


async def render_completion(request: web.Request) -> web.Response:
    """``POST /v1/completions/render``: a list, one ``GenerateRequest`` per prompt."""
    return web.json_response(await _render(request, chat=False))


async def render_chat(request: web.Request) -> web.Response:
    """``POST /v1/chat/completions/render``: one ``GenerateRequest``."""
    return web.json_response((await _render(request, chat=True))[0])


def add_render_routes(app: web.Application) -> None:
    """Register both render routes on ``app`` (``api.make_app`` calls it)."""
    app.router.add_post("/v1/completions/render", render_completion)
    app.router.add_post("/v1/chat/completions/render", render_chat)
