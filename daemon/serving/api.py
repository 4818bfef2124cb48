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
* ``DELETE /v1/requests/{id}``: abort (404 if not live; a beam's sequence id aborts its whole
  beam search, ``Engine.abort_members``). ``POST /tokenize``: ``{"prompt"}``
  or ``{"messages"}`` → ``{"tokens", "count"}``, parsed and limited as for generation and
  tokenized by the same input processor. ``POST /v1/shutdown``: graceful stop (what
  ``llmd stop`` calls; same as SIGTERM).
* ``POST /detokenize`` (vLLM's): ``{"tokens": [id, ...]}`` → ``{"prompt": text}``, special
  tokens kept, decoded on the tokenizer pool; ``GET /version``: ``{"version"}``, llmd's.
* ``POST /v1/completions/render``, ``POST /v1/chat/completions/render``: vLLM's render (the
  token ids and sampling parameters a request would run with, nothing generated; ``render.py``).
* ``GET /v1/debug/integrity``: only when ``LLMD_DEBUG_ROUTES=1`` is in the daemon's
  environment (a test hook): the KV manager's ``check_integrity()`` run between two steps,
  the per-request tables' sizes and the fault injector's counts; 500 when an invariant fails.

Off the event loop: bodies over ``JSON_OFF_LOOP_BYTES`` are decoded on a worker thread, and
prompts are tokenized on the engine loop's tokenizer pool; streams are written through
``streaming.py`` (merged deltas, per-write timeout), connections are capped and idle ones
closed by ``connections.ServingRunner``.

This module assembles the application (:func:`make_app`); the routes are
``generation_routes.py`` (completions, chat) and ``admin_routes.py`` (the rest), what they share
(:class:`ServerState`, reading a body, the error middleware) is ``http_common.py``, re-exported
here for the modules that import it from this one.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status. A request
that fails in the engine (``finish_reason="error"``: its own postprocessing or logits, or a
whole failed step) answers 500 with ``type: "server_error"``, or in a stream an event
``data: {"error": ...}`` then ``data: [DONE]`` (vLLM's ``GenerationError`` handling); its
sibling sequences (``n`` > 1) are aborted. A client
that disconnects (streaming or not; the app runs with ``handler_cancellation=True``) has
its request aborted: the handler's ``finally`` queues an abort, honoured within one step.
"""

from __future__ import annotations

import os

from aiohttp import web

from llmd.daemon.serving.admin_routes import (
    abort_request,
    debug_integrity,
    detokenize,
    health,
    metrics,
    models,
    reset_cache,
    shutdown,
    stats,
    tokenize,
    version,
)
from llmd.daemon.serving.generation_routes import chat_completions, completions
from llmd.daemon.serving.http_common import (
    MAX_BODY_BYTES,
    STATE,
    ServerState,
    check_size,
    engine_error,
    error_middleware,
    loading_middleware,
    read_json,
)
from llmd.daemon.serving.kv_transfer.tcp import PULL_PATH, pull_route

# as before the split: render.py, lifecycle.py, the bench and tests import these from here
__all__ = ["DEBUG_ROUTES_ENV", "MAX_BODY_BYTES", "STATE", "ServerState", "check_size", "engine_error", "make_app",
           "read_json"]

DEBUG_ROUTES_ENV = "LLMD_DEBUG_ROUTES"  # "1": also serve GET /v1/debug/integrity (tests only)


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
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
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
