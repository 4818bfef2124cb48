"""The generating routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

A body is parsed (``validation.parse_request``), each prompt's text checked against the context
untokenized (:func:`check_size`), the KV handshake run (``kv_transfer/handshake.py``), and one
engine request submitted per prompt (``multi_prompt.PromptBatch``; prompts are tokenized on the
engine loop's tokenizer pool). The answer is one JSON body (``responses.ResponseBuilder``) or,
with ``stream: true``, Server-Sent Events ending in ``data: [DONE]``, written through
``streaming.py`` (merged deltas, every write bounded by ``limits.write_timeout``).

While the daemon drains, or when the engine thread is not running, a request answers 503. A
request that fails in the engine (``finish_reason="error"``: its own postprocessing or logits, or
a whole failed step) answers 500 with ``type: "server_error"``, or in a stream an event
``data: {"error": ...}`` then ``data: [DONE]`` (vLLM's ``GenerationError`` handling); its sibling
sequences (``n`` > 1) are aborted. A client that disconnects (streaming or not; the app runs with
``handler_cancellation=True``) has its request aborted: the handler's ``finally`` queues an
abort, honoured within one step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid

from aiohttp import web

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.protocol import DRAINING_CODE, SSE_DONE, error_body, sse
from llmd.daemon.serving.http_common import STATE, check_size, engine_error, json_error, read_json
from llmd.daemon.serving.json_fields import ApiError
from llmd.daemon.serving.kv_transfer import handshake as kv_handshake
from llmd.daemon.serving.multi_prompt import PromptBatch, echo_texts
from llmd.daemon.serving.responses import ResponseBuilder
from llmd.daemon.serving.streaming import OutputBuffer, write
from llmd.daemon.serving.validation import parse_request

log = logging.getLogger("llmd.server")
# the open SSE response of a streaming request (a typed key where aiohttp has them, >= 3.12: a
# plain string key there warns NotAppKeyWarning)
SSE_RESPONSE = web.RequestKey("sse_response", web.StreamResponse) if hasattr(web, "RequestKey") else "sse_response"


def engine_failure(out) -> str:
    """The client's message for an output with ``finish_reason="error"``."""
    return f"the request failed in the engine ({out.error or 'see the daemon log'})"


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    st = request.app[STATE]
    if st.draining:
        raise ApiError("the daemon is shutting down", None, 503, code=DRAINING_CODE)
    if not st.engine_loop.alive:
        raise ApiError("the engine is not running (see the daemon log)", None, 503)
    body = await read_json(request)
    parsed = parse_request(body, chat, st.model_ids, st.vocab_size, st.max_model_len)
    prompts = parsed.prompts or [parsed.prompt]  # a /v1/completions batch: one engine request each
    for p in prompts:
        check_size(p, st.max_model_len, chat)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    outputs = OutputBuffer()  # engine thread → event loop; deltas merge while the client is behind
    kv = await kv_handshake.prepare(st.kv_transfer, st.engine_loop, body, parsed, prompts)  # a consumer pulls here
    batch = PromptBatch(st.engine_loop, rid, prompts, parsed, outputs.sink(asyncio.get_running_loop()),
                        kv.submit_kw if kv is not None else None)
    done = False
    try:
        try:
            num_seqs, n_prompts = await batch.wait()
        except LlmdError as e:
            done = len(prompts) == 1  # a batch's other prompts may be queued: `finally` aborts them
            raise engine_error(e, chat) from None
        tok = st.engine_loop.engine.tokenizer.hf
        text_of = (lambda i: f"token_id:{i}") if parsed.tokens_as_ids else _token_text(tok)
        bytes_of = None if parsed.tokens_as_ids else _token_bytes(tok, text_of)
        echo = await echo_texts(prompts, st.engine_loop) if parsed.echo else None
        builder = ResponseBuilder(rid, st.model_id, chat, parsed.n, parsed.logprobs, text_of, parsed.tool_calling,
                                  len(prompts), echo, parsed.continuous_usage, token_bytes=bytes_of)
        builder.prompt_tokens = n_prompts
        if parsed.stream:
            try:
                await _stream(request, builder, outputs, parsed, num_seqs, batch.abort)
            except ConnectionResetError:  # the client left mid-stream: abort (finally), no traceback
                log.debug("client of %s disconnected", rid)
                return request[SSE_RESPONSE]
        else:
            remaining, pinned = num_seqs, None
            while remaining:
                for out in await outputs.take():
                    if out.finish_reason == "error":  # 500; `finally` aborts the siblings
                        return json_error(engine_failure(out), None, 500, "server_error")
                    builder.absorb(out.index, out)
                    pinned = out.kv_transfer_params or pinned
                    remaining -= out.finished
        done = True
        if parsed.stream:
            return request[SSE_RESPONSE]
        final = builder.final_body()
        if kv is not None:  # vLLM puts the producer's params at the top of the body
            final["kv_transfer_params"] = kv.response_params(pinned)
        return web.json_response(final)
    finally:
        if not done:  # client went away or we failed: free the engine's blocks
            batch.abort()


async def _stream(request: web.Request, builder: ResponseBuilder, outputs: OutputBuffer, parsed, n: int,
                  abort) -> None:
    """Write the SSE stream of ``n`` sequences: every write bounded by ``limits.write_timeout``
    (a stalled reader is disconnected: ConnectionResetError); what is pending meanwhile merges
    in ``outputs``; ``abort()`` aborts every sequence (one failed in the engine)."""
    timeout = request.app[STATE].limits.write_timeout
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    request[SSE_RESPONSE] = resp
    await resp.prepare(request)
    usage = parsed.include_usage
    roles = b"".join(sse(c) for c in builder.role_chunks(usage))
    if roles:
        await write(request, resp, roles, timeout)
    remaining = n
    while remaining:
        chunks = []
        for out in await outputs.take():
            remaining -= out.finished
            if out.finish_reason == "error":  # an error event, [DONE], and the siblings aborted
                abort()
                chunks.append(sse(error_body(engine_failure(out), None, "server_error", 500)))
                remaining, usage = 0, False
                break
            chunk = builder.delta_chunk(out.index, out, usage)
            if chunk is not None:
                chunks.append(sse(chunk))
        if chunks:
            await write(request, resp, b"".join(chunks), timeout)
    tail = (sse(builder.usage_chunk()) if usage else b"") + SSE_DONE
    await write(request, resp, tail, timeout)
    await resp.write_eof()


def _token_text(hf_tokenizer):
    @functools.lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return hf_tokenizer.decode([token_id], skip_special_tokens=False)

    return text


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable character → the byte it stands for
    (``bytes_to_unicode``: printable Latin-1 bytes map to themselves, the other 68 to U+0100…)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(extra)}


def _token_bytes(hf_tokenizer, text_of):
    """token id → its raw bytes as a list of ints (chat logprobs' ``bytes``; OpenAI: joined
    over a reply's tokens they give its UTF-8 text, also where one character spans tokens).

    A token whose text decodes whole is its UTF-8; one that holds part of a character (its
    lone decode ends in U+FFFD) is read from its vocabulary string: a byte-level BPE token
    (SmolLM2, Qwen3: ``"ðŁĺ"`` = F0 9F 98) through GPT-2's alphabet, a byte-fallback token
    (Gemma: ``"<0xF0>"``) as that byte; any other keeps the UTF-8 of its text."""

    @functools.lru_cache(maxsize=65536)
    def raw(token_id: int) -> tuple[int, ...]:
        text = text_of(token_id)
        if "\ufffd" in text:
            piece = hf_tokenizer.convert_ids_to_tokens([token_id])[0] or ""
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return (int(piece[3:5], 16),)
            decoder = _byte_level_decoder()
            if piece and all(c in decoder for c in piece):
                return tuple(decoder[c] for c in piece)
        return tuple(text.encode())

    return lambda token_id: list(raw(token_id))
