"""Small clients for the daemon's Unix socket: :class:`Client` (sync, stdlib ``http.client``)
and :class:`AsyncClient` (aiohttp). Used by ``llmd chat`` / ``ps`` / ``status`` / ``stop``,
the dashboard and the tests.

Both raise :class:`DaemonUnavailable` when nothing listens on the socket (:class:`DaemonStarting`
when a daemon holds ``<socket>.lock`` but has not bound the socket yet) and
:class:`ApiResponseError` (``.status``, ``.message``, ``.param``) for a 4xx/5xx answer.
Building either on a path over the AF_UNIX limit raises :class:`LlmdError` with
``protocol.check_socket_path``'s line, so every client command says that in one line.
Streams yield the decoded JSON of each Server-Sent Event until ``[DONE]``; closing the
iterator early closes the connection, which makes the daemon abort the request.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import AsyncIterator, Iterator

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.protocol import check_socket_path, default_socket_path


class DaemonUnavailable(LlmdError):
    """No daemon answers on the socket (missing file, refused connection)."""


class DaemonStarting(DaemonUnavailable):
    """A daemon holds ``<socket>.lock`` (process ``pid``) but has not bound its socket yet
    (``llmd serve`` importing torch, checking its options): try again in a moment, start no other."""

    def __init__(self, socket_path: str, pid: int):
        self.pid = pid
        super().__init__(f"the llmd daemon on {socket_path} (pid {pid}) is starting: its socket is not up yet; "
                         "try again in a moment")


def unavailable(socket_path: str, reason: str) -> DaemonUnavailable:
    """The error for a connection to ``socket_path`` that failed (``reason``: the OS's words,
    e.g. ``No such file or directory``): :class:`DaemonStarting` when a daemon is starting on
    the path (``spawn.starting_pid``), else "no llmd daemon on PATH (reason); start one with
    `llmd serve`"."""
    from llmd.daemon.client.spawn import starting_pid  # spawn imports this module

    pid = starting_pid(socket_path)
    if pid is not None:
        return DaemonStarting(socket_path, pid)
    return DaemonUnavailable(f"no llmd daemon on {socket_path} ({reason}); start one with `llmd serve`")


def checked_socket_path(socket_path: str | None) -> str:
    """``socket_path``, else :func:`default_socket_path` (``$LLMD_SOCKET`` ...), checked.

    Raises:
        LlmdError: the path is over the AF_UNIX limit (``protocol.check_socket_path``'s line;
            connecting would raise ``OSError: AF_UNIX path too long``).
    """
    path = socket_path or default_socket_path()
    problem = check_socket_path(path)
    if problem:
        raise LlmdError(problem)
    return path


class ApiResponseError(LlmdError):
    """The daemon answered with an error status; ``message``/``param``/``code`` come from its error
    body (``code``: OpenAI's string code, e.g. ``"shutting_down"`` for a draining daemon's 503)."""

    def __init__(self, status: int, body):
        err = body.get("error", {}) if isinstance(body, dict) else {}
        self.status, self.body = status, body
        self.message = err.get("message") or str(body)
        self.param = err.get("param")
        self.code = err.get("code")
        super().__init__(f"daemon answered {status}: {self.message}")


def _decode(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return {"error": {"message": raw.decode(errors="replace")[:500]}}


def _parse_sse_line(line: bytes):
    """Return the event's JSON, ``None`` for a non-data line, or ``StopIteration`` at ``[DONE]``."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return StopIteration
    return json.loads(data)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None):
        super().__init__("llmd", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.unix_path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            s.close()
            raise unavailable(self.unix_path, e.strerror) from None
        except OSError:
            s.close()
            raise
        self.sock = s


class Client:
    """Synchronous client. One connection per call (the daemon is local; no pooling needed).

    Args:
        socket_path: the daemon's socket (default: :func:`default_socket_path`).
        timeout: seconds to wait on connect and on each read (None: forever).
    Raises:
        LlmdError: ``socket_path`` is over the AF_UNIX limit (:func:`checked_socket_path`).
    """

    def __init__(self, socket_path: str | None = None, timeout: float | None = 600.0):
        self.socket_path = checked_socket_path(socket_path)
        self.timeout = timeout

    def _send(self, method: str, path: str, body=None) -> tuple[_UnixHTTPConnection, http.client.HTTPResponse]:
        conn = _UnixHTTPConnection(self.socket_path, self.timeout)
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, path, body=data, headers=headers)
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def request(self, method: str, path: str, body=None):
        """One JSON round trip; returns the decoded body or raises :class:`ApiResponseError`."""
        conn, resp = self._send(method, path, body)
        try:
            raw = resp.read()
        finally:
            conn.close()
        out = _decode(raw)
        if resp.status >= 400:
            raise ApiResponseError(resp.status, out)
        return out

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """POST ``body`` with ``stream: true``; yield each SSE chunk until ``[DONE]``."""
        conn, resp = self._send("POST", path, {**body, "stream": True})
        try:
            if resp.status >= 400:
                raise ApiResponseError(resp.status, _decode(resp.read()))
            while True:
                line = resp.readline()
                if not line:
                    return
                ev = _parse_sse_line(line)
                if ev is StopIteration:
                    return
                if ev is not None:
                    yield ev
        finally:
            conn.close()

    # ---- conveniences -------------------------------------------------------------
    def health(self, ready_only: bool = True) -> dict | None:
        """``/health``'s body when the daemon is ready (200), else None: nothing answers, or it
        answers 503 (loading, engine dead or stalled: the body's ``status`` and ``reason``),
        whose body ``ready_only=False`` returns instead."""
        try:
            return self.request("GET", "/health")
        except ApiResponseError as e:
            if ready_only or e.status != 503:
                return None
            return e.body
        except (DaemonUnavailable, ConnectionError, socket.timeout, http.client.HTTPException):
            return None

    def stats(self, cells: int | None = None) -> dict:
        return self.request("GET", "/v1/stats" + (f"?cells={cells}" if cells else ""))

    def models(self) -> dict:
        return self.request("GET", "/v1/models")

    def completion(self, **body) -> dict:
        return self.request("POST", "/v1/completions", body)

    def chat(self, **body) -> dict:
        return self.request("POST", "/v1/chat/completions", body)

    def abort(self, request_id: str) -> dict:
        """Abort a live request by id (``DELETE /v1/requests/{id}``; 404 when it is not live)."""
        return self.request("DELETE", f"/v1/requests/{request_id}")

    def reset_prefix_cache(self) -> dict:
        """Evict every cached-but-free block from the prefix cache (``POST /v1/cache/reset``)."""
        return self.request("POST", "/v1/cache/reset")

    def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        body = {"prompt": prompt} if messages is None else {"messages": messages}
        return self.request("POST", "/tokenize", body)["tokens"]

    def shutdown(self) -> dict:
        return self.request("POST", "/v1/shutdown")


class AsyncClient:
    """aiohttp client over the Unix socket; use as ``async with AsyncClient(path) as c``.

    Args:
        socket_path: the daemon's socket (default: :func:`default_socket_path`).
        timeout: total seconds per request (None: no limit).
    Raises:
        LlmdError: ``socket_path`` is over the AF_UNIX limit (:func:`checked_socket_path`).
    """

    def __init__(self, socket_path: str | None = None, timeout: float | None = 600.0):
        self.socket_path = checked_socket_path(socket_path)
        self.timeout = timeout
        self._session = None

    async def __aenter__(self) -> "AsyncClient":
        import aiohttp

        self._session = aiohttp.ClientSession(
            base_url="http://llmd", connector=aiohttp.UnixConnector(path=self.socket_path),
            timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _wrap(self, e: Exception) -> Exception:
        """aiohttp's connect error as the sync client's (the OS's words, not aiohttp's
        "Cannot connect to unix socket ... ssl:default [...]")."""
        return unavailable(self.socket_path, getattr(e, "strerror", None) or str(getattr(e, "os_error", e)))

    async def request(self, method: str, path: str, body=None):
        import aiohttp

        try:
            async with self._session.request(method, path, json=body) as resp:
                out = _decode(await resp.read())
                if resp.status >= 400:
                    raise ApiResponseError(resp.status, out)
                return out
        except aiohttp.ClientConnectorError as e:
            raise self._wrap(e) from None

    async def stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST with ``stream: true``; yield each SSE chunk until ``[DONE]``."""
        import aiohttp

        try:
            resp = await self._session.post(path, json={**body, "stream": True})
        except aiohttp.ClientConnectorError as e:
            raise self._wrap(e) from None
        try:
            if resp.status >= 400:
                raise ApiResponseError(resp.status, _decode(await resp.read()))
            async for line in resp.content:
                ev = _parse_sse_line(line)
                if ev is StopIteration:
                    return
                if ev is not None:
                    yield ev
        finally:
            resp.close()

    async def stats(self, cells: int | None = None) -> dict:
        return await self.request("GET", "/v1/stats" + (f"?cells={cells}" if cells else ""))

    async def health(self) -> dict | None:
        try:
            return await self.request("GET", "/health")
        except (DaemonUnavailable, ApiResponseError):
            return None
