"""Slow, stalled and idle clients against the daemon's real runner (``ServingRunner`` on a Unix
socket, in-process) over a tiny random-GGUF engine: a stalled SSE reader is disconnected after
the write timeout and its request aborted while another client is served; an idle or half-sent
connection is closed after the header timeout; connections over the cap get a 503. Deltas merge
in ``OutputBuffer`` while the handler is behind."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
import time

import pytest
from tiny_engine import tiny_engine

from llmd.daemon.core.outputs import RequestOutput
from llmd.daemon.serving.api import ServerState, make_app
from llmd.daemon.serving.connections import ServingLimits, ServingRunner
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.streaming import OutputBuffer

LIMITS = ServingLimits(max_connections=4, header_timeout=0.5, write_timeout=0.5)


@pytest.fixture(scope="module")
def engine_loop(tmp_path_factory):
    engine = tiny_engine(tmp_path_factory.mktemp("tiny") / "tiny.gguf", max_num_seqs=8)
    loop = EngineLoop(engine, "tiny").start()
    yield loop
    loop.stop()


def serve(engine_loop, scenario):
    """Run ``scenario(path)`` (blocking, in a thread) against a ServingRunner on a fresh socket."""

    async def main():
        eng = engine_loop.engine
        state = ServerState(engine_loop=engine_loop, model_id="tiny", model_ids=("tiny",),
                            vocab_size=eng.model_config.vocab_size, max_model_len=eng.max_model_len,
                            shutdown=asyncio.Event(), limits=LIMITS)
        runner = ServingRunner(make_app(state), LIMITS, handler_cancellation=True, access_log=None)
        await runner.setup()
        path = os.path.join(tempfile.mkdtemp(prefix="llmd", dir="/tmp"), "s.sock")
        from aiohttp import web

        await web.UnixSite(runner, path).start()
        try:
            return await asyncio.to_thread(scenario, path), runner.refused
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def post(path: str, route: str, body: dict, timeout: float = 30.0) -> tuple[int, bytes]:
    s = connect(path)
    s.settimeout(timeout)
    data = json.dumps(body).encode()
    s.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
              "Connection: close\r\n\r\n".encode() + data)
    raw = b""
    while chunk := s.recv(65536):
        raw += chunk
    s.close()
    return int(raw.split(b" ", 2)[1]), raw


def closed_within(s: socket.socket, seconds: float, received: list | None = None) -> float | None:
    """Seconds until the server closes ``s`` (reading what it sent into ``received``), or None."""
    s.settimeout(0.05)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            data = s.recv(1 << 20)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0
        if not data:
            return time.monotonic() - t0
        if received is not None:
            received.append(data)
    return None


def test_stalled_stream_reader_is_disconnected_and_others_are_served(engine_loop):
    """A stream (n=4, top-20 logprobs: MBs of SSE) whose client never reads: the write times
    out, the connection is closed and the request aborted (no block held); meanwhile another
    client's request completes normally."""

    def scenario(path):
        s = connect(path)
        body = json.dumps({"prompt": "a", "max_tokens": 400, "n": 4, "logprobs": 20, "stream": True,
                           "ignore_eos": True}).encode()
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        t0 = time.monotonic()
        status, raw = post(path, "/v1/completions", {"prompt": "b", "max_tokens": 20, "temperature": 0})
        other_s = time.monotonic() - t0
        time.sleep(3.0)  # the stalled one fills the socket buffers, then its write times out
        live = engine_loop.num_live
        received: list[bytes] = []
        closed = closed_within(s, 10.0, received)
        s.close()
        return status, json.loads(raw.split(b"\r\n\r\n", 1)[1]), other_s, live, closed, b"".join(received)

    (status, other, other_s, live, closed, got), _ = serve(engine_loop, scenario)
    assert status == 200 and len(other["choices"][0]["text"]) == 20 and other_s < 10
    assert live == 0  # aborted after the write timeout, long before 400 tokens × 4 were read
    assert closed is not None and b"[DONE]" not in got  # cut off, not merely slow
    assert engine_loop.engine.kv_manager.num_used_blocks == 0


def test_idle_and_half_sent_connections_are_closed_after_the_header_timeout(engine_loop):
    def scenario(path):
        idle, half = connect(path), connect(path)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        return closed_within(idle, 5.0), closed_within(half, 5.0)

    (idle, half), _ = serve(engine_loop, scenario)
    assert idle is not None and half is not None and max(idle, half) < 3.0


def test_connections_over_the_cap_get_503_then_are_served_again(engine_loop):
    def scenario(path):
        held = [connect(path) for _ in range(LIMITS.max_connections)]
        time.sleep(0.1)
        over = connect(path)
        over.settimeout(5)
        refused = over.recv(4096)
        for s in held:
            s.close()
        time.sleep(0.1)
        return refused, post(path, "/tokenize", {"prompt": "ok"})

    (refused, (status, raw)), n_refused = serve(engine_loop, scenario)
    assert refused.startswith(b"HTTP/1.1 503") and b"too many open connections (limit 4)" in refused
    assert n_refused == 1 and status == 200 and b'"count":2' in raw.replace(b" ", b"")


def test_output_buffer_merges_deltas_while_the_reader_is_behind():
    """100 outputs put while nobody takes: one pending delta per sequence, tokens and text
    concatenated in order, counts and finish from the latest."""

    async def main():
        buf = OutputBuffer()
        for i in range(100):
            for index in (0, 1):
                buf.put(RequestOutput(f"r-{index}", [i], str(i % 10), [None], finished=i == 99,
                                      finish_reason="length" if i == 99 else None, num_output_tokens=i + 1,
                                      index=index))
        assert buf.num_pending == 2
        return await buf.take(), buf.merged

    outs, merged = asyncio.run(main())
    assert merged == 198 and [o.index for o in outs] == [0, 1]
    for o in outs:
        assert o.new_token_ids == list(range(100)) and o.new_text == "0123456789" * 10 and len(o.logprobs) == 100
        assert o.finished and o.finish_reason == "length" and o.num_output_tokens == 100
