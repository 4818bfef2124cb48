"""``AsyncClient`` (``llmd bench serve``) says a missing daemon as the sync client does
(``no llmd daemon on PATH (No such file or directory); start one with `llmd serve```), not in
aiohttp's words (``Cannot connect to unix socket PATH ssl:default [...]``)."""

from __future__ import annotations

import asyncio
import time

import pytest
from click.testing import CliRunner

from llmd.daemon.cli.main import main
from llmd.daemon.client.client import AsyncClient, Client, DaemonUnavailable


def test_async_and_sync_clients_say_no_daemon_alike(tmp_path):
    path = str(tmp_path / "none.sock")
    with pytest.raises(DaemonUnavailable) as sync:
        Client(path).stats()

    async def stats():
        async with AsyncClient(path) as ac:
            await ac.request("GET", "/v1/stats")

    with pytest.raises(DaemonUnavailable) as asynchronous:
        asyncio.run(stats())
    assert str(asynchronous.value) == str(sync.value) == \
        f"no llmd daemon on {path} (No such file or directory); start one with `llmd serve`"


def test_bench_serve_without_a_daemon_is_the_usual_line_at_once(tmp_path):
    """Said before the load starts: with the defaults (64 requests at 4/s) it came after ~15 s
    of arrivals."""
    path = str(tmp_path / "none.sock")
    t0 = time.monotonic()
    result = CliRunner().invoke(main, ["bench", "serve", "--socket", path])
    assert result.exit_code == 1 and time.monotonic() - t0 < 5, (result.output, result.exception)
    assert result.output.splitlines() == [f"llmd: error: no llmd daemon on {path} (No such file or directory); "
                                          "start one with `llmd serve`"], result.output
