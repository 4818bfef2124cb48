"""Who may use the daemon over TCP: the API key, loopback-only Host / Origin, JSON bodies.

The Unix socket is guarded by the file system (directory 0700, socket 0600: only its owner
can connect), so nothing here applies to it: its requests pass untouched and the README's
``curl --unix-socket ... -d '{...}'`` examples work as they are (vLLM and llama-server have
no socket to compare with). A TCP listener (``llmd serve --host/--port``) is reachable by
every local user, and by web pages through the browser, so on TCP:

1. **Host** (loopback binds only): a request whose ``Host`` header names anything but
   ``localhost``, a 127.0.0.0/8 address or ``[::1]`` (any port) gets 403. A page that rebinds
   its own DNS name to 127.0.0.1 still sends its own name as ``Host`` (DNS rebinding).
2. **Origin** (loopback binds only): a request carrying an ``Origin`` that is not a loopback
   site (``null`` included) gets 403: browsers send ``Origin`` on cross-site POSTs, so a
   foreign page cannot drive the daemon (Ollama's ``OLLAMA_ORIGINS`` idea, with no list).
3. **API key** (when one is set): every route but ``/health`` and ``/metrics`` (open, as in
   vLLM and llama-server, so routers can probe them) needs ``Authorization: Bearer KEY``,
   compared with :func:`hmac.compare_digest`; missing or wrong → 401, OpenAI's error shape
   with code 401 and ``WWW-Authenticate: Bearer``. vLLM (``--api-key``, ``VLLM_API_KEY``)
   and llama-server (``--api-key``, ``--api-key-file``) take the same header.
4. **Content-Type**: a POST with a body must say ``application/json`` (415 otherwise): a web
   page can send a ``text/plain`` POST cross-site without a CORS preflight, never a JSON one.

A non-loopback bind without a key is refused before anything listens
(:func:`check_bind`), and so is an address that cannot be bound (:func:`check_listen`). The
key is read from ``$LLMD_API_KEY`` or ``--api-key-file`` (:func:`resolve_api_key`); it is
never logged or echoed.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from aiohttp import web

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.protocol import error_body, error_type

API_KEY_ENV = "LLMD_API_KEY"
#: routes a TCP client may call without the key (load balancers and Prometheus probe them)
OPEN_PATHS = frozenset({"/health", "/metrics"})


def is_loopback_host(host: str | None) -> bool:
    """Whether a host name or address (no port; IPv6 with or without brackets) is loopback:
    ``localhost`` (any case, a trailing dot allowed), 127.0.0.0/8 or ``::1``."""
    if not host:
        return False
    host = host.strip().rstrip(".").lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of_header(value: str) -> str:
    """The host part of a ``Host`` header value: ``[::1]:8000`` → ``[::1]``, ``a:80`` → ``a``."""
    value = value.strip()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class AccessPolicy:
    """What a TCP request must satisfy.

    Attributes:
        api_key: the Bearer token every guarded route needs; None = no key (loopback binds only).
        loopback: the listener is bound to a loopback address: enforce loopback ``Host`` and
            ``Origin`` headers.
    """

    api_key: str | None = field(default=None, repr=False)  # never in a repr, so never in a log
    loopback: bool = True


def _error(message: str, status: int, headers: dict | None = None) -> web.Response:
    """OpenAI's error shape (``protocol.error_body``) with ``status`` as its code."""
    return web.json_response(error_body(message, None, error_type(status), status), status=status, headers=headers)


def is_tcp(request: web.Request) -> bool:
    """Whether the request came over TCP: its socket name is an (address, port, ...) tuple; a
    Unix socket's is its path. A request whose transport is already gone counts as TCP (fail closed)."""
    transport = request.transport
    return transport is None or isinstance(transport.get_extra_info("sockname"), tuple)


def check_request(policy: AccessPolicy, request: web.Request) -> web.Response | None:
    """The refusal for a TCP ``request`` under ``policy`` (403 / 401 / 415), or None to let it through."""
    headers = request.headers
    if policy.loopback:
        host = headers.get("Host")
        if host is not None and not is_loopback_host(host_of_header(host)):
            return _error(f"Host {host!r} is not a loopback name; this daemon listens on loopback only "
                          "(a DNS-rebinding guard)", 403)
        origin = headers.get("Origin")
        if origin is not None and not is_loopback_host(urlsplit(origin).hostname if origin != "null" else None):
            return _error(f"requests from the web origin {origin!r} are refused (only loopback origins may call "
                          "this daemon)", 403)
    if policy.api_key is not None and request.path not in OPEN_PATHS:
        scheme, _, token = headers.get("Authorization", "").partition(" ")
        given = token.strip().encode("utf-8", "backslashreplace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, policy.api_key.encode()):
            return _error("missing or wrong API key: send the header 'Authorization: Bearer <key>'", 401,
                          {"WWW-Authenticate": "Bearer"})
    if request.method == "POST" and request.body_exists and request.content_type != "application/json":
        sent = headers.get("Content-Type", "no Content-Type")
        return _error(f"Content-Type must be application/json on the TCP listener, got {sent!r}", 415)
    return None


def access_middleware(policy: AccessPolicy):
    """An aiohttp middleware applying :func:`check_request` to TCP requests only (the Unix
    socket's pass untouched). Put it first, outside the error middleware."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if is_tcp(request):
            refusal = check_request(policy, request)
            if refusal is not None:
                return refusal
        return await handler(request)

    return middleware


def check_bind(host: str, port: int, api_key: str | None) -> None:
    """Refuse a non-loopback TCP bind without a key.

    Raises:
        LlmdError: ``host`` is not loopback and ``api_key`` is None.
    """
    if api_key is None and not is_loopback_host(host):
        raise LlmdError(f"refusing to listen on {host}:{port} without an API key (anyone who can reach it could "
                        f"use and stop the daemon): set ${API_KEY_ENV} or --api-key-file, or bind 127.0.0.1")


def listen_error(host: str, port: int, err: OSError) -> str:
    """``cannot listen on HOST:PORT: REASON``: the OS's reason for ``err`` (asyncio wraps a bind
    error in its own sentence: only the errno's text is kept), lower-cased as asyncio words it."""
    if isinstance(err, socket.gaierror) or not err.errno:
        reason = err.strerror or str(err)
    else:
        reason = os.strerror(err.errno)
    where = f"[{host}]" if ":" in host else host
    return f"cannot listen on {where}:{port}: {reason[:1].lower()}{reason[1:]}"


def check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` and let go, as the daemon's listener will (asyncio's ``create_server``
    under aiohttp's ``TCPSite``: every address ``host`` resolves to, ``SO_REUSEADDR``, IPv6 only
    on an IPv6 socket), so a port in use or an address not of this machine is one line before
    the socket is claimed or the model loads. A port taken between this and the real bind is
    caught there (``lifecycle.run_server``).

    Raises:
        LlmdError: ``port`` out of 1–65535 (``--port``'s range), ``host`` unresolvable, or a bind fails.
    """
    if not 1 <= port <= 65535:
        raise LlmdError(f"cannot listen on {host}:{port}: the port must be in 1-65535")
    try:
        infos = set(socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE))
    except OSError as e:
        raise LlmdError(listen_error(host, port, e)) from None
    for family, type_, proto, _, addr in infos:
        try:
            s = socket.socket(family, type_, proto)
        except OSError:
            continue  # asyncio skips a family this machine lacks too
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
        except OSError as e:
            raise LlmdError(listen_error(host, port, e)) from None
        finally:
            s.close()


def check_key(key: str, source: str) -> str:
    """``key`` if it can travel in an ``Authorization`` header (printable ASCII, no spaces).

    Raises:
        LlmdError: empty, or with spaces / control / non-ASCII characters (named by ``source``;
            the key itself is never shown).
    """
    if not key:
        raise LlmdError(f"the API key from {source} is empty")
    if not all(33 <= ord(c) < 127 for c in key):
        raise LlmdError(f"the API key from {source} must be printable ASCII without spaces")
    return key


def read_api_key_file(path: str) -> tuple[str, str | None]:
    """The key in ``path`` (surrounding whitespace stripped) and a warning when the file is
    readable by group or others (None otherwise).

    Raises:
        LlmdError: the file cannot be read, or holds no valid key (:func:`check_key`).
    """
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise LlmdError(f"cannot read --api-key-file {path}: {getattr(e, 'strerror', None) or e}") from None
    warning = (f"llmd: warning: {path} is readable by other users; `chmod 600 {path}`"
               if stat.S_IMODE(mode) & 0o044 else None)
    return check_key(key, f"--api-key-file {path}"), warning


def resolve_api_key(api_key: str | None, api_key_file: str | None, environ=os.environ) -> tuple[str | None, list]:
    """The TCP listener's key: ``--api-key-file``, else ``--api-key``, else ``$LLMD_API_KEY``.

    Returns:
        (key or None, warning lines): ``--api-key`` is accepted (vLLM's and llama-server's
        flag) with a warning, since a command line is readable by every local user through
        ``/proc/PID/cmdline``.
    Raises:
        LlmdError: both flags given, an unreadable file, or an invalid key.
    """
    if api_key is not None and api_key_file is not None:
        raise LlmdError("give one of --api-key-file and --api-key, not both")
    if api_key_file is not None:
        key, warning = read_api_key_file(api_key_file)
        return key, [warning] if warning else []
    if api_key is not None:
        return check_key(api_key, "--api-key"), [
            f"llmd: warning: a key given with --api-key is visible to every local user in /proc/PID/cmdline; "
            f"use ${API_KEY_ENV} or --api-key-file"]
    env = environ.get(API_KEY_ENV)
    return (check_key(env, f"${API_KEY_ENV}") if env else None), []
