"""The routes beside generation: health, models, stats, metrics, aborts, the prefix-cache reset,
tokenize, shutdown, and the debug integrity hook.

* ``GET /health``: 200 ``ok`` / ``draining``; 503 ``loading`` / ``dead`` / ``stalled`` with a
  one-line ``reason`` (``engine_health.py``). While the model loads (no stats snapshot yet)
  ``uptime_s`` counts from the engine loop's creation.
* ``GET /v1/models``: the served model, ``created`` at the daemon's start.
* ``GET /v1/stats[?cells=K]``: ``cells`` an integer in [1, 100000], else 400.
* ``GET /metrics``: refreshed from the engine's stats on each scrape; 404 without metrics.
* ``DELETE /v1/requests/{id}``: 404 unless the request is live. ``POST /v1/cache/reset``: drops
  the cached blocks no request uses, ``{"reset": blocks dropped}``.
* ``POST /tokenize``: the prompt parsed and limited as a generation's (``prompt_fields.py``) and
  tokenized on the same tokenizer pool, off the engine thread.
* ``POST /detokenize`` (vLLM's): ``{"tokens": [id, ...], "model"?}`` → ``{"prompt": text}``,
  special tokens kept; ``tokens`` checked by ``prompt_fields.parse_tokens`` (400 ``param``
  ``tokens``), ``model`` as generation's (404 ``model_not_found``); decoded on the tokenizer pool.
* ``GET /version``: ``{"version": the installed llmd's version}`` (vLLM reports its own).
* ``POST /v1/shutdown``: sets the shutdown switch, 202 (what ``llmd stop`` calls; as SIGTERM).
* ``GET /v1/debug/integrity``: the KV manager's audit, registered by ``api.make_app`` only under
  ``LLMD_DEBUG_ROUTES=1``.
"""

from __future__ import annotations

import asyncio
import os
import time

from aiohttp import web

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.kv_transfer import llmd_version
from llmd.daemon.protocol import stats_with_cells
from llmd.daemon.serving.http_common import STATE, check_size, engine_error, read_json
from llmd.daemon.serving.json_fields import ApiError, json_value
from llmd.daemon.serving.prompt_fields import parse_prompt, parse_tokens
from llmd.daemon.serving.validation import check_model


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
    if isinstance(body, dict):  # first, as generation and vLLM's /tokenize: another model is a 404
        check_model(body, st.model_ids)
    prompt = parse_prompt(body, chat, st.vocab_size, st.max_model_len)  # generation's limits
    check_size(prompt, st.max_model_len, chat)
    try:
        ids = await asyncio.wrap_future(st.engine_loop.tokenize(prompt))  # the tokenizer pool, as every prompt
    except LlmdError as e:
        raise engine_error(e, chat) from None
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": st.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    """``{"tokens": [id, ...]}`` → ``{"prompt": text}`` (special tokens kept), decoded on the
    tokenizer pool. 400 naming ``tokens`` (missing, not a list of vocabulary ids, more than
    64 × the context); 404 ``model_not_found`` for another ``model``; 503 when the engine loop
    has stopped."""
    st = request.app[STATE]
    body = await read_json(request)
    if isinstance(body, dict):  # first, as generation checks it
        check_model(body, st.model_ids)
    ids = parse_tokens(body, st.vocab_size, st.max_model_len)
    try:
        text = await asyncio.wrap_future(st.engine_loop.detokenize(ids))
    except LlmdError as e:  # the tokenizer pool is shut down
        raise ApiError(str(e), None, 503) from None
    return web.json_response({"prompt": text})


async def version(request: web.Request) -> web.Response:
    """``{"version": "0.1.0"}``: the installed llmd's version (``importlib.metadata``)."""
    return web.json_response({"version": llmd_version()})


async def debug_integrity(request: web.Request) -> web.Response:
    """The KV manager's audit between two steps (:meth:`EngineLoop.check_integrity`); 200 when
    it holds, 500 naming the broken invariant. Registered only under ``LLMD_DEBUG_ROUTES=1``."""
    report = await asyncio.wrap_future(request.app[STATE].engine_loop.check_integrity())
    return web.json_response(report, status=200 if report["ok"] else 500)


async def shutdown(request: web.Request) -> web.Response:
    request.app[STATE].shutdown.set()
    return web.json_response({"status": "shutting down"}, status=202)
