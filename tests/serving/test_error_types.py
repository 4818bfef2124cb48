"""The error body's ``type`` follows its HTTP status, in OpenAI's lowercase style: a full waiting
queue's 429 is ``rate_limit_error``; every 503 (draining, a dead engine, loading) ``server_error``,
with the ``code`` each already had (``shutting_down`` for the drain, else the status); other 4xx
stay ``invalid_request_error``. No engine is built: the routes answer before reaching one."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmd.daemon.core.errors import QueueFullError
from llmd.daemon.protocol import error_type
from llmd.daemon.serving.api import ServerState, make_app
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.http_common import engine_error, error_middleware

BODY = {"prompt": "hi", "max_tokens": 2}


def test_type_of_each_status():
    assert [error_type(s) for s in (400, 401, 404, 413, 429, 500, 503)] == [
        "invalid_request_error", "authentication_error", "invalid_request_error", "invalid_request_error",
        "rate_limit_error", "server_error", "server_error"]


def test_full_queue_429_is_a_rate_limit_error():
    """The scheduler's QueueFullError through the error middleware: 429, ``Retry-After: 1``,
    ``type: "rate_limit_error"``, ``code: 429``."""

    async def handler(request):
        raise engine_error(QueueFullError("the waiting queue is full (1 request); retry later"))

    async def main():
        app = web.Application(middlewares=[error_middleware])
        app.router.add_post("/v1/completions", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/completions", json=BODY)
            return resp.status, resp.headers.get("Retry-After"), await resp.json()

    status, retry_after, body = asyncio.run(main())
    assert status == 429 and retry_after == "1", body
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == 429, body


def test_every_503_is_a_server_error_and_keeps_its_code():
    """Draining (``code: "shutting_down"``), an engine thread that is not running and a model
    still loading (``code: 503``) all answer ``type: "server_error"``."""
    loop = EngineLoop(lambda: None, "tiny")  # never started: not alive

    async def ask(**state_kw):
        state = ServerState(engine_loop=loop, model_id="tiny", model_ids=("tiny",), vocab_size=100,
                            max_model_len=64, shutdown=asyncio.Event(), **state_kw)
        async with TestClient(TestServer(make_app(state))) as client:
            resp = await client.post("/v1/completions", json=BODY)
            return resp.status, (await resp.json())["error"]

    draining, dead, loading = (asyncio.run(ask(**kw)) for kw in ({"draining": True}, {}, {"loaded": False}))
    assert draining == (503, {"message": "the daemon is shutting down", "type": "server_error", "param": None,
                              "code": "shutting_down"}), draining
    assert dead[0] == 503 and dead[1]["type"] == "server_error" and dead[1]["code"] == 503, dead
    assert "not running" in dead[1]["message"]
    assert loading[0] == 503 and loading[1]["type"] == "server_error" and loading[1]["code"] == 503, loading
