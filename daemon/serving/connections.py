"""Connection limits of the daemon's listeners: an open-connection cap, a header (idle)
timeout and the per-write timeout the handlers apply (``streaming.write``).

* ``max_connections``: open connections per runner (Unix socket and TCP together). One over
  the cap is answered at once with a 503 JSON error (``Connection: close``) and closed, never
  queued: a process has ~1,024 descriptors by default, and each connection is one. uvicorn's
  ``--limit-concurrency`` (what vLLM runs under) answers 503 the same way.
* ``header_timeout``: a connection that has not sent a complete request head this many
  seconds after it opened, or after its last response (keep-alive), is closed. aiohttp's
  ``keepalive_timeout`` is exactly this since 3.10 (it is armed at ``connection_made``: "there's
  no other protection against a dead connection that doesn't send a request at all"); its
  default is an hour. Requests being answered (a long stream included) are not affected.
  uvicorn's keep-alive default, which vLLM keeps, is 5 s; llmd's is longer because
  ``llmd top`` and pooled clients reuse idle connections.
* ``write_timeout``: seconds one write to a client that does not read may wait before the
  connection is aborted (llama-server's ``--timeout`` covers reads and writes, default 600 s).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from aiohttp import web

from llmd.daemon.protocol import error_body


@dataclass(frozen=True)
class ServingLimits:
    """Connection limits (seconds, counts); see the module docstring."""

    max_connections: int = 512
    header_timeout: float = 30.0
    write_timeout: float = 30.0


def _busy_response(limit: int) -> bytes:
    body = json.dumps(error_body(f"too many open connections (limit {limit}); retry later", None,
                                 "server_error", 503)).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _Refuse(asyncio.Protocol):
    """A connection over the cap: the 503 is written, then the connection closed."""

    def __init__(self, response: bytes):
        self.response = response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.response)  # type: ignore[attr-defined]
        transport.close()


class _CappedFactory:
    """The protocol factory the sites get: aiohttp's handler until ``limit`` connections are
    open, then :class:`_Refuse`."""

    def __init__(self, server: web.Server, limit: int):
        self.server, self.limit = server, limit
        self.refused = 0
        self._response = _busy_response(limit)

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.limit:
            self.refused += 1
            return _Refuse(self._response)
        return self.server()


class ServingRunner(web.AppRunner):
    """``web.AppRunner`` with :class:`ServingLimits`: ``header_timeout`` as aiohttp's
    ``keepalive_timeout``, and sites that refuse connections beyond ``max_connections``.

    Args:
        app: the application (``api.make_app``).
        limits: the limits (defaults when None).
        **kwargs: as ``web.AppRunner`` (``handler_cancellation``, ``access_log`` ...).
    """

    def __init__(self, app: web.Application, limits: ServingLimits | None = None, **kwargs):
        self.limits = limits or ServingLimits()
        super().__init__(app, keepalive_timeout=self.limits.header_timeout, **kwargs)
        self._capped: _CappedFactory | None = None

    @property
    def server(self):
        """What every site serves: the capped factory over aiohttp's server (None before setup)."""
        inner = super().server
        if inner is None:
            return None
        if self._capped is None or self._capped.server is not inner:
            self._capped = _CappedFactory(inner, self.limits.max_connections)
        return self._capped

    @property
    def refused(self) -> int:
        """Connections refused over the cap so far."""
        return self._capped.refused if self._capped else 0
