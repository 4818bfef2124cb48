"""The HTTP API (aiohttp): OpenAI-style endpoints in front of the :class:`EngineLoop`.

Endpoints (JSON unless noted):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI shapes; ``stream: true``
  answers with Server-Sent Events ending in ``data: [DONE]``.
* ``GET /v1/models``, ``GET /health`` (``{"status": "ok", "pid", "model", "model_ids", "uptime_s"}``;
  ``model_ids``: every name the ``model`` field accepts). ``/health`` answers 503 with
  ``status`` ``"loading"``, ``"dead"`` or ``"stalled"`` and a one-line ``reason`` while the
  model loads, when the engine thread is not running, and when no engine step has finished
  for ``health_stall_timeout`` seconds (``engine_health.py``); while loading, every route but
  ``/health``, ``/metrics`` and ``/v1/shutdown`` answers 503 too.
* ``GET /v1/stats[?cells=K]``: the versioned snapshot of ``protocol.py``.
* ``GET /metrics``: Prometheus text (``metrics.py``: ``llmd:`` names, plus ``vllm:`` ones
  with ``--metrics-compat vllm``); 404 when the daemon runs without metrics.
* ``DELETE /v1/requests/{id}``: abort (404 if not live). ``POST /tokenize``: ``{"prompt"}``
  or ``{"messages"}`` → ``{"tokens", "count"}``, parsed and limited as for generation and
  tokenized by the same input processor. ``POST /v1/shutdown``: graceful stop (what
  ``llmd stop`` calls; same as SIGTERM).
* ``POST /v1/completions/render``, ``POST /v1/chat/completions/render``: vLLM's render (the
  token ids and sampling parameters a request would run with, nothing generated; ``render.py``).
* ``GET /v1/debug/integrity``: only when ``LLMD_DEBUG_ROUTES=1`` is in the daemon's
  environment (a test hook): the KV manager's ``check_integrity()`` run between two steps,
  the per-request tables' sizes and the fault injector's counts; 500 when an invariant fails.

Off the event loop: bodies over ``JSON_OFF_LOOP_BYTES`` are decoded on a worker thread, and
prompts are tokenized on the engine loop's tokenizer pool; streams are written through
``streaming.py`` (merged deltas, per-write timeout), connections are capped and idle ones
closed by ``connections.ServingRunner``.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status. A request
that fails in the engine (``finish_reason="error"``: its own postprocessing or logits, or a
whole failed step) answers 500 with ``type: "server_error"``, or in a stream an event
``data: {"error": ...}`` then ``data: [DONE]`` (vLLM's ``GenerationError`` handling); its
sibling sequences (``n`` > 1) are aborted. A client
that disconnects (streaming or not; the app runs with ``handler_cancellation=True``) has
its request aborted: the handler's ``finally`` queues an abort, honoured within one step.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from llmd.daemon.core.errors import LlmdError, ServerBusyError
from llmd.daemon.core.input_processor import check_prompt_size
from llmd.daemon.protocol import SSE_DONE, error_body, sse, stats_with_cells
from llmd.daemon.serving.connections import ServingLimits
from llmd.daemon.serving.engine_health import DEFAULT_STALL_TIMEOUT_S
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.kv_transfer import handshake as kv_handshake
from llmd.daemon.serving.kv_transfer.tcp import PULL_PATH, pull_route
from llmd.daemon.serving.multi_prompt import PromptBatch, echo_texts
from llmd.daemon.serving.responses import ResponseBuilder
from llmd.daemon.serving.streaming import OutputBuffer, write
from llmd.daemon.serving.validation import ApiError, json_value, parse_prompt, parse_request

log = logging.getLogger("llmd.server")
MAX_BODY_BYTES = 8 * 2**20
JSON_OFF_LOOP_BYTES = 64 * 2**10  # bodies above this are decoded on a worker thread (8 MiB: ~40 ms)
DEBUG_ROUTES_ENV = "LLMD_DEBUG_ROUTES"  # "1": also serve GET /v1/debug/integrity (tests only)


@dataclass
class ServerState:
    """What handlers share: the engine loop, the served model ids and the shutdown switch."""

    engine_loop: EngineLoop
    model_id: str
    model_ids: tuple[str, ...]
    vocab_size: int
    max_model_len: int
    shutdown: asyncio.Event
    draining: bool = False
    metrics: object | None = None  # a metrics.DaemonMetrics, or None (no /metrics)
    limits: ServingLimits = ServingLimits()  # write_timeout here; the rest is the runner's
    health_stall_timeout: float = DEFAULT_STALL_TIMEOUT_S  # seconds without a finished step → /health 503
    loaded: bool = True  # False while the engine loads (vocab_size, max_model_len, model_ids not final yet)
    kv_transfer: object | None = None  # a kv_transfer.config.KVTransferConfig (None: --kv-role both)


STATE = web.AppKey("state", ServerState)
# the open SSE response of a streaming request (a typed key where aiohttp has them, >= 3.12: a
# plain string key there warns NotAppKeyWarning)
SSE_RESPONSE = web.RequestKey("sse_response", web.StreamResponse) if hasattr(web, "RequestKey") else "sse_response"
#: what answers while the model loads (everything else: 503)
OPEN_WHILE_LOADING = frozenset({"/health", "/metrics", "/v1/shutdown"})


def json_error(message: str, param: str | None = None, status: int = 400,
               type_: str = "invalid_request_error", code: str | None = None) -> web.Response:
    """The error response; the body's ``code`` is ``code`` (OpenAI's string) or the status."""
    return web.json_response(error_body(message, param, type_, code or status), status=status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """ApiError → its 4xx; aiohttp HTTP errors → JSON; anything else → logged 500, daemon keeps serving."""
    try:
        return await handler(request)
    except ApiError as e:
        resp = json_error(e.message, e.param, e.status, code=e.code)
        resp.headers.update(e.headers)
        return resp
    except web.HTTPRequestEntityTooLarge as e:  # aiohttp's client_max_size: say the limit
        return json_error(f"request body too large: the limit is {MAX_BODY_BYTES // 2**20} MiB", None, e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_error(e.reason, None, e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return json_error("internal server error (see the daemon log)", None, 500, "server_error")


@web.middleware
async def loading_middleware(request: web.Request, handler):
    """While the engine loads (the socket already answers ``/health`` with 503 ``loading``),
    every route but :data:`OPEN_WHILE_LOADING` answers 503."""
    if not request.app[STATE].loaded and request.path not in OPEN_WHILE_LOADING:
        return json_error("the model is still loading; retry once /health answers 200", None, 503, "server_error")
    return await handler(request)


def engine_failure(out) -> str:
    """The client's message for an output with ``finish_reason="error"``."""
    return f"the request failed in the engine ({out.error or 'see the daemon log'})"


async def read_json(request: web.Request):
    try:
        raw = await request.read()
        if len(raw) > JSON_OFF_LOOP_BYTES:  # keep the event loop (other streams' writes) moving
            return await asyncio.get_running_loop().run_in_executor(None, json.loads, raw)
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's 4,300-digit limit
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError("the request body is JSON nested too deeply") from None


def engine_error(e: LlmdError, chat: bool = False) -> ApiError:
    """Map an engine rejection to its HTTP error: a full waiting queue → 429 with
    ``Retry-After``; anything else → 400 naming the field the error carries (its ``param``),
    the endpoint's prompt field (``messages`` for chat, ``prompt`` for completions) when it
    carries none or the prompt."""
    if isinstance(e, ServerBusyError):
        return ApiError(str(e), None, 429, {"Retry-After": str(e.retry_after)})
    param = getattr(e, "param", None)
    if param in (None, "prompt", "messages"):
        param = "messages" if chat else "prompt"
    return ApiError(str(e), param)


def check_size(prompt, max_model_len: int, chat: bool) -> None:
    """:func:`check_prompt_size` (text too long for the context, refused untokenized) as an ApiError."""
    try:
        check_prompt_size(prompt, max_model_len)
    except LlmdError as e:
        raise engine_error(e, chat) from None


# ---- generation ---------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    st = request.app[STATE]
    if st.draining:
        raise ApiError("the daemon is shutting down", None, 503)
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
        echo = await echo_texts(prompts, tok) if parsed.echo else None
        builder = ResponseBuilder(rid, st.model_id, chat, parsed.n, parsed.logprobs, text_of, parsed.tool_calling,
                                  len(prompts), echo, parsed.continuous_usage)
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


# ---- the rest -----------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    """200 ``ok`` / ``draining``; 503 ``loading`` / ``dead`` / ``stalled`` with a ``reason``."""
    st = request.app[STATE]
    snap = st.engine_loop.snapshot()
    state, reason = ("loading", "the model is loading") if not st.loaded else \
        st.engine_loop.health_state(st.health_stall_timeout)
    body = {"status": "draining" if st.draining and state == "ok" else state, "pid": os.getpid(),
            "model": st.model_id, "model_ids": list(st.model_ids),
            # no snapshot while the model loads: the time since the loop was made, not 0
            "uptime_s": snap.get("uptime_s", time.monotonic() - st.engine_loop.started_at)}
    if reason:
        body["reason"] = reason
    return web.json_response(body, status=200 if state == "ok" else 503)


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    created = int(time.time() - st.engine_loop.snapshot().get("uptime_s", 0.0))
    return web.json_response({"object": "list", "data": [{"id": st.model_id, "object": "model", "created": created,
                                                          "owned_by": "llmd", "max_model_len": st.max_model_len}]})


async def stats(request: web.Request) -> web.Response:
    cells = request.query.get("cells")
    if cells is not None:
        if not cells.isdigit() or not 1 <= int(cells) <= 100_000:
            raise ApiError(f"cells must be an integer in [1, 100000], got {json_value(cells)}", "cells")
        cells = int(cells)
    return web.json_response(stats_with_cells(request.app[STATE].engine_loop.snapshot(), cells))


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.metrics is None:
        raise ApiError("metrics are not enabled on this daemon", None, 404)
    st.metrics.refresh(st.engine_loop.stats())
    return web.Response(body=st.metrics.render(), headers={"Content-Type": st.metrics.content_type})


async def abort_request(request: web.Request) -> web.Response:
    rid = request.match_info["request_id"]
    live = await asyncio.wrap_future(request.app[STATE].engine_loop.abort(rid))
    if not live:
        raise ApiError(f"no live request with id {rid!r}", "request_id", 404)
    return web.json_response({"id": rid, "aborted": True})


async def reset_cache(request: web.Request) -> web.Response:
    """Drop every cached block that no request is using; ``{"reset": blocks dropped}``."""
    n = await asyncio.wrap_future(request.app[STATE].engine_loop.reset_prefix_cache())
    return web.json_response({"reset": n})


async def tokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = await read_json(request)
    chat = isinstance(body, dict) and "messages" in body
    prompt = parse_prompt(body, chat, st.vocab_size, st.max_model_len)  # generation's limits
    check_size(prompt, st.max_model_len, chat)
    try:
        ids = await asyncio.wrap_future(st.engine_loop.tokenize(prompt))  # the tokenizer pool, as every prompt
    except LlmdError as e:
        raise engine_error(e, chat) from None
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": st.max_model_len})


async def debug_integrity(request: web.Request) -> web.Response:
    """The KV manager's audit between two steps (:meth:`EngineLoop.check_integrity`); 200 when
    it holds, 500 naming the broken invariant. Registered only under ``LLMD_DEBUG_ROUTES=1``."""
    report = await asyncio.wrap_future(request.app[STATE].engine_loop.check_integrity())
    return web.json_response(report, status=200 if report["ok"] else 500)


async def shutdown(request: web.Request) -> web.Response:
    request.app[STATE].shutdown.set()
    return web.json_response({"status": "shutting down"}, status=202)


def make_app(state: ServerState, access=None) -> web.Application:
    """The aiohttp application; run it with ``handler_cancellation=True`` on the runner.

    ``access``: an ``access.access_middleware`` for a TCP listener (runs first, before the
    error middleware), or None (the Unix socket alone needs none)."""
    app = web.Application(middlewares=[*([access] if access else []), error_middleware, loading_middleware],
                          client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_delete("/v1/requests/{request_id}", abort_request)
    app.router.add_post("/v1/cache/reset", reset_cache)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/shutdown", shutdown)
    kvt = state.kv_transfer
    if kvt is not None and kvt.role == "producer":  # serve the KV pull (kv_transfer/tcp.py)
        app.router.add_post(PULL_PATH, pull_route(lambda: state.engine_loop))
    if kvt is not None and kvt.connector is not None:  # a consumer's pull session
        app.on_cleanup.append(lambda _app: kvt.connector.close())
    from llmd.daemon.serving.render import add_render_routes  # it imports this module's helpers

    add_render_routes(app)
    if os.environ.get(DEBUG_ROUTES_ENV) == "1":  # test hooks (the soak test); absent in production
        app.router.add_get("/v1/debug/integrity", debug_integrity)
    return app
