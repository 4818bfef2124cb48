"""What every route shares: the app's :class:`ServerState`, the request-body reader, and the
mapping of errors to responses.

Errors are ``{"error": {"message", "type", "param", "code"}}`` (:func:`json_error`): an
:class:`ApiError` answers its 4xx (and its headers: ``Retry-After``); an engine rejection
(:class:`LlmdError`) is a 400 naming the field, a full waiting queue a 429 (:func:`engine_error`);
a body over ``MAX_BODY_BYTES`` is a 413 saying the limit; anything else is logged and answers 500,
and the daemon keeps serving (:func:`error_middleware`). While the model loads, every route but
:data:`OPEN_WHILE_LOADING` answers 503 (:func:`loading_middleware`). The body's ``type`` follows
the status (``protocol.error_type``): 429 ``rate_limit_error``, every 5xx ``server_error``,
401 ``authentication_error``, any other 4xx ``invalid_request_error``.

Bodies over ``JSON_OFF_LOOP_BYTES`` are decoded on a worker thread (:func:`read_json`), so the
event loop (other streams' writes) keeps moving; a body that is not JSON, or is nested too deeply,
is a 400.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass

from aiohttp import web

from llmd.daemon.core.errors import LlmdError, ServerBusyError
from llmd.daemon.core.input_processor import check_prompt_size
from llmd.daemon.protocol import error_body, error_type
from llmd.daemon.serving.connections import ServingLimits
from llmd.daemon.serving.engine_health import DEFAULT_STALL_TIMEOUT_S
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.json_fields import ApiError, parse_float

log = logging.getLogger("llmd.server")
MAX_BODY_BYTES = 8 * 2**20
JSON_OFF_LOOP_BYTES = 64 * 2**10  # bodies above this are decoded on a worker thread (8 MiB: ~40 ms)


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
#: what answers while the model loads (everything else: 503)
OPEN_WHILE_LOADING = frozenset({"/health", "/metrics", "/v1/shutdown"})


def json_error(message: str, param: str | None = None, status: int = 400,
               type_: str | None = None, code: str | None = None) -> web.Response:
    """The error response; the body's ``type`` is ``type_`` or the status's (:func:`error_type`:
    429 ``rate_limit_error``, 5xx ``server_error``), its ``code`` is ``code`` (OpenAI's string)
    or the status."""
    return web.json_response(error_body(message, param, type_ or error_type(status), code or status), status=status)


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
        return json_error("internal server error (see the daemon log)", None, 500)


@web.middleware
async def loading_middleware(request: web.Request, handler):
    """While the engine loads (the socket already answers ``/health`` with 503 ``loading``),
    every route but :data:`OPEN_WHILE_LOADING` answers 503."""
    if not request.app[STATE].loaded and request.path not in OPEN_WHILE_LOADING:
        return json_error("the model is still loading; retry once /health answers 200", None, 503)
    return await handler(request)


async def read_json(request: web.Request):
    try:
        raw = await request.read()
        loads = functools.partial(json.loads, parse_float=parse_float)  # 1e400 quoted as written
        if len(raw) > JSON_OFF_LOOP_BYTES:  # keep the event loop (other streams' writes) moving
            return await asyncio.get_running_loop().run_in_executor(None, loads, raw)
        return loads(raw)
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
