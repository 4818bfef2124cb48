"""The TCP access middleware in-process (``daemon/serving/access.py``): a bare aiohttp app with
echo routes behind it, on a real TCP port (aiohttp's TestServer, 127.0.0.1) and on a real Unix
socket, so the listener detection and every refusal are tested in milliseconds. The real
daemon's TCP listener is tested in ``tests/e2e/test_tcp_access.py``."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.serving.access import (
    AccessPolicy,
    access_middleware,
    check_bind,
    host_of_header,
    is_loopback_host,
    resolve_api_key,
)

KEY = "s3cret-Key_0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


def echo_app(policy: AccessPolicy) -> web.Application:
    async def ok(request):
        return web.json_response({"path": request.path, "body": (await request.read()).decode()})

    app = web.Application(middlewares=[access_middleware(policy)])
    for path in ("/health", "/metrics", "/v1/models", "/tokenize"):
        app.router.add_get(path, ok)
    for path in ("/v1/completions", "/v1/shutdown", "/tokenize"):
        app.router.add_post(path, ok)
    return app


def over_tcp(policy: AccessPolicy, scenario):
    async def main():
        async with TestClient(TestServer(echo_app(policy), host="127.0.0.1")) as client:
            return await scenario(client)

    return asyncio.run(main())


def test_loopback_names():
    assert all(is_loopback_host(h) for h in ("localhost", "LOCALHOST", "localhost.", "127.0.0.1", "127.3.2.1",
                                             "::1", "[::1]"))
    assert not any(is_loopback_host(h) for h in ("", None, "evil.example", "localhost.evil.example",
                                                 "127.0.0.1.evil.example", "0.0.0.0", "10.0.0.1", "[::]"))
    assert [host_of_header(v) for v in ("localhost:8000", "[::1]:8000", "[::1]", "a.b", "::1")] == \
        ["localhost", "[::1]", "[::1]", "a.b", "::1"]


def test_key_guards_everything_but_health_and_metrics():
    async def scenario(c):
        out = {}
        for path in ("/health", "/metrics", "/v1/models", "/tokenize"):
            out[path] = (await c.get(path)).status
        bad = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        out["body"] = await bad.json()
        out["www"] = bad.headers.get("WWW-Authenticate")
        out["basic"] = (await c.get("/v1/models", headers={"Authorization": f"Basic {KEY}"})).status
        out["prefix"] = (await c.get("/v1/models", headers={"Authorization": f"Bearer {KEY[:-1]}"})).status
        out["good"] = (await c.get("/v1/models", headers=AUTH)).status
        out["lower"] = (await c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})).status
        out["shutdown"] = (await c.post("/v1/shutdown", json={})).status
        return out

    out = over_tcp(AccessPolicy(KEY), scenario)
    assert out["/health"] == 200 and out["/metrics"] == 200
    assert out["/v1/models"] == 401 and out["/tokenize"] == 401 and out["shutdown"] == 401
    assert out["body"]["error"]["code"] == 401 and "API key" in out["body"]["error"]["message"]
    assert KEY not in str(out["body"]) and out["www"] == "Bearer"
    assert out["basic"] == out["prefix"] == 401 and out["good"] == out["lower"] == 200


def test_foreign_host_and_origin_refused_on_a_loopback_bind():
    async def scenario(c):
        out = {}
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "localhost", "127.0.0.1:9",
                     "[::1]:8000"):
            out[host] = (await c.get("/health", headers={"Host": host})).status
        for origin in ("http://evil.example", "null", "http://localhost.evil.example", "http://localhost:3000",
                       "http://127.0.0.1", "http://[::1]:8080"):
            out[origin] = (await c.post("/v1/completions", json={}, headers={"Origin": origin})).status
        refused = await c.get("/health", headers={"Host": "evil.example"})
        out["body"] = await refused.json()
        return out

    out = over_tcp(AccessPolicy(None, loopback=True), scenario)
    assert out["evil.example"] == out["evil.example:80"] == out["127.0.0.1.evil.example"] == 403
    assert out["localhost"] == out["127.0.0.1:9"] == out["[::1]:8000"] == 200
    assert out["http://evil.example"] == out["null"] == out["http://localhost.evil.example"] == 403
    assert out["http://localhost:3000"] == out["http://127.0.0.1"] == out["http://[::1]:8080"] == 200
    assert out["body"]["error"]["code"] == 403 and "loopback" in out["body"]["error"]["message"]
    # a non-loopback bind (a key is then required) cannot check Host: any name may reach it
    assert over_tcp(AccessPolicy(KEY, loopback=False),
                    lambda c: c.get("/v1/models", headers={"Host": "gpu-box.lan:8000", **AUTH})).status == 200


def test_post_bodies_must_be_json_on_tcp():
    async def scenario(c):
        plain = await c.post("/v1/completions", data=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
        form = await c.post("/v1/completions", data=b'{"prompt": "hi"}',
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
        charset = await c.post("/v1/completions", data=b'{"prompt": "hi"}',
                               headers={"Content-Type": "application/json; charset=utf-8"})
        empty = await c.post("/v1/shutdown")  # no body: nothing to type
        return plain.status, (await plain.json())["error"]["message"], form.status, charset.status, empty.status

    plain, message, form, charset, empty = over_tcp(AccessPolicy(None), scenario)
    assert plain == form == 415 and "application/json" in message and "text/plain" in message
    assert charset == 200 and empty == 200


def test_unix_socket_requests_pass_untouched(tmp_path):
    """The same app on a Unix socket: no key, any Host, text/plain (curl -d) bodies all pass."""
    path = str(tmp_path / "a.sock")

    async def main():
        runner = web.AppRunner(echo_app(AccessPolicy(KEY)))
        await runner.setup()
        await web.UnixSite(runner, path).start()
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as s:
                r1 = await s.post("http://evil.example/v1/completions", data=b'{"prompt": "hi"}',
                                  headers={"Content-Type": "application/x-www-form-urlencoded",
                                           "Origin": "http://evil.example"})
                r2 = await s.get("http://llmd/v1/models")
                return r1.status, (await r1.json())["body"], r2.status
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == (200, '{"prompt": "hi"}', 200)


def test_bind_refusal_and_key_sources(tmp_path):
    with pytest.raises(LlmdError, match="refusing to listen on 0.0.0.0:8000 without an API key"):
        check_bind("0.0.0.0", 8000, None)
    with pytest.raises(LlmdError, match="without an API key"):
        check_bind("gpu-box.lan", 8000, None)
    check_bind("0.0.0.0", 8000, KEY)
    check_bind("127.0.0.1", 8000, None)
    check_bind("localhost", 8000, None)

    assert resolve_api_key(None, None, {}) == (None, [])
    assert resolve_api_key(None, None, {"LLMD_API_KEY": KEY}) == (KEY, [])
    key, warnings = resolve_api_key(KEY, None, {})
    assert key == KEY and len(warnings) == 1 and "/proc/PID/cmdline" in warnings[0] and KEY not in warnings[0]
    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    os.chmod(f, 0o600)
    assert resolve_api_key(None, str(f), {"LLMD_API_KEY": "other"}) == (KEY, [])
    os.chmod(f, 0o644)
    key, warnings = resolve_api_key(None, str(f), {})
    assert key == KEY and "readable by other users" in warnings[0]
    for bad, match in (((KEY, str(f)), "not both"), ((None, str(tmp_path / "missing")), "cannot read"),
                       (("two words", None), "printable ASCII")):
        with pytest.raises(LlmdError, match=match) as ei:
            resolve_api_key(*bad, {})
        assert "two words" not in str(ei.value)
    f.write_text("\n")
    with pytest.raises(LlmdError, match="is empty"):
        resolve_api_key(None, str(f), {})
    assert KEY not in repr(AccessPolicy(KEY))
