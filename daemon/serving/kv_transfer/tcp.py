"""llmd's KV transport: a binary pull over the producer's authenticated TCP listener.

``POST /v1/kv_transfer/pull`` with ``{"transfer_id": ...}`` on the producer's ``--host/--port``
listener, so it passes :mod:`llmd.daemon.serving.access` like every route there: the consumer
sends the same API key (``Authorization: Bearer``), a JSON body and a loopback ``Host`` on a
loopback bind. The answer is ``application/octet-stream``: one :mod:`.wire` payload with a
``Content-Length``; 404 (OpenAI's error body) when the transfer id names no live pin (never
pinned, expired, pulled already: one pull per pin). The producer copies the blocks out and
frees the pin before it writes a byte, so a consumer that dies mid-pull leaks nothing there.

Why this transport (README "Prefill/decode disaggregation" has the measurements): it reuses the
one listener, key and guard the daemon already has (no second port, no unauthenticated
rendezvous such as ``torch.distributed``'s TCP store, no fixed world of ranks: any consumer can
pull from any producer), and on loopback it moves the KV at memory-copy speeds.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from llmd.daemon.core.kv_exchange import KVTransferError
from llmd.daemon.core.kv_transfer import KVPayload
from llmd.daemon.protocol import error_body
from llmd.daemon.serving.kv_transfer.connector import KVPullError, RemoteKV
from llmd.daemon.serving.kv_transfer.wire import PREFIX_BYTES, WireError, build, check_header, encode, header_length

log = logging.getLogger("llmd.kv_transfer")
PULL_PATH = "/v1/kv_transfer/pull"
CHUNK = 4 << 20  # bytes per write
READ_BUFSIZE = 8 << 20  # the consumer's read buffer (aiohttp pauses the socket above it)
EXPORT_TIMEOUT_S = 30.0  # the engine thread answers between two steps


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class TcpPullConnector:
    """The consumer's end (a :class:`~.connector.KVConnector`): one aiohttp session, reused.

    Args:
        api_key: sent as ``Authorization: Bearer`` (the producer's key; llmd's daemons of one
            deployment share one), or None for a producer without a key.
    """

    def __init__(self, api_key: str | None):
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def pull(self, remote: RemoteKV, max_bytes: int, timeout: float) -> KVPayload:
        if self._session is None or self._session.closed:  # large reads: no 64 KiB flow-control stalls
            self._session = aiohttp.ClientSession(read_bufsize=READ_BUFSIZE)
        url = f"http://{_url_host(remote.host)}:{remote.port}{PULL_PATH}"
        try:
            async with self._session.post(url, json={"transfer_id": remote.transfer_id}, headers=self._headers,
                                          timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise KVPullError(f"the producer {remote.host}:{remote.port} answered HTTP {resp.status}: {text}")
                header = check_header(await resp.content.readexactly(header_length(
                    await resp.content.readexactly(PREFIX_BYTES))), max_bytes)
                bodies = [await _read_into(resp.content, t["nbytes"]) for t in header["tensors"]]
                return build(header, bodies)
        except KVPullError:
            raise
        except asyncio.TimeoutError:
            raise KVPullError(f"the pull from {remote.host}:{remote.port} timed out after {timeout:g} s") from None
        except asyncio.IncompleteReadError as e:
            raise KVPullError(f"the producer {remote.host}:{remote.port} closed the pull after "
                              f"{len(e.partial)} of {e.expected} bytes of a part") from None
        except (aiohttp.ClientError, OSError, WireError) as e:
            raise KVPullError(f"the pull from {remote.host}:{remote.port} failed: {type(e).__name__}: {e}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _read_into(stream: aiohttp.StreamReader, n: int) -> bytearray:
    """Exactly ``n`` bytes into one buffer (no concatenation). Raises IncompleteReadError."""
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        chunk = await stream.read(n - pos)  # what is buffered, up to the rest of this part
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:pos]), n)
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return buf


def pull_route(get_engine_loop):
    """The producer's ``POST`` :data:`PULL_PATH` handler; ``get_engine_loop()`` returns the
    :class:`~llmd.daemon.serving.engine_loop.EngineLoop` (read per request)."""

    async def pull(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        tid = body.get("transfer_id") if isinstance(body, dict) else None
        if not isinstance(tid, str) or not tid:
            return web.json_response(error_body("transfer_id must be a non-empty string", "transfer_id",
                                                "invalid_request_error", 400), status=400)
        try:
            fut = get_engine_loop().export_kv(tid)
            payload, fault = await asyncio.wait_for(asyncio.wrap_future(fut), EXPORT_TIMEOUT_S)
        except KVTransferError as e:
            return web.json_response(error_body(str(e), "transfer_id", "invalid_request_error", 404), status=404)
        prefix, bodies = encode(payload)
        total = len(prefix) + sum(len(b) for b in bodies)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = total
        await resp.prepare(request)
        await resp.write(prefix)
        kind, value = fault or (None, 0.0)
        if kind == "kv_pull_stall":
            await asyncio.sleep(value)
        sent, limit = len(prefix), total // 2 if kind == "kv_pull_cut" else total
        for b in bodies:
            for i in range(0, len(b), CHUNK):
                part = b[i : i + min(CHUNK, limit - sent)]
                await resp.write(part)
                sent += len(part)
                if sent >= limit < total:  # a producer dying mid-pull (test fault)
                    log.warning("injected fault: cutting a KV pull after %d of %d bytes", sent, total)
                    request.transport.close()
                    return resp
        await resp.write_eof()
        return resp

    return pull
