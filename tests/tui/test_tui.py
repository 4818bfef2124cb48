"""``llmd top`` without a daemon: ``App.run_test()`` pilot tests driven by ``/v1/stats`` payloads
recorded from a real daemon (``tests/fixtures/data/stats_*.json``; ``e2e/test_tui_daemon.py`` checks they still
match what the daemon sends). The payloads come from ``fixtures/stats_payloads.py``; a fake
client and the screenshot's text live here; the pure helpers are tested in ``test_tui_units.py``."""

from __future__ import annotations

import asyncio
import copy
import html
import re

from stats_payloads import SELECTED_ID, expand, future_payload, load  # noqa: F401 (expand: test_tui_units)

from llmd.daemon.client.client import ApiResponseError, DaemonUnavailable
from llmd.daemon.protocol import STATS_SCHEMA_VERSION
from llmd.tui import map_cells as mc
from llmd.tui.app import TopApp
from llmd.tui.block_map import BlockMap
from llmd.tui.confirm_screen import ConfirmScreen
from llmd.tui.header_bar import HeaderBar
from llmd.tui.request_table import RequestTable


class FakeClient:
    """Answers ``stats()`` with ``answer`` (raised when it is an exception); records calls."""

    socket_path = "/tmp/llmd-fake.sock"

    def __init__(self, answer):
        self.answer, self.calls, self.fail = answer, [], None

    def stats(self):
        self.calls.append(("stats",))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return copy.deepcopy(self.answer)

    def abort(self, request_id):
        self.calls.append(("abort", request_id))
        if self.fail:
            raise self.fail
        return {"id": request_id, "aborted": True}

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return {"reset": 3}


def screen_lines(app) -> list[str]:
    """The exported SVG screenshot's text, as one string per terminal line."""
    w, h = app.size
    rows = [[" "] * w for _ in range(h)]
    for x, line, text in re.findall(r'<text class="[^"]*-r\d+" x="([\d.]+)" y="[\d.]+" textLength="[\d.]+" '
                                    r'clip-path="url\(#[^)]*-line-(\d+)\)">([^<]*)</text>', app.export_screenshot()):
        col = round(float(x) / 12.2)  # rich's SVG: 0.61 × 20 px per cell
        for i, ch in enumerate(html.unescape(text).replace("\xa0", " ")):
            if int(line) < h and col + i < w:
                rows[int(line)][col + i] = ch
    return ["".join(r) for r in rows]


async def poll(app, pilot) -> None:
    await app.poll_now()
    await pilot.pause()


# ---- pilot tests --------------------------------------------------------------------------
def test_main_screen_80x24_renders_the_recorded_payload(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")  # glyphs carry the map without colour

    async def go():
        app = TopApp(FakeClient(load("busy")), interval=1000)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert app.no_color and app.kind == "live"
            lines = screen_lines(app)
            text = "\n".join(lines)
            for s in ("smollm2-135m", "float32", "block 16", "windows full", "live: /tmp/llmd-fake.sock",
                      "KV blocks (727 usable)", "in use", "○ cached", "· free", "× null",
                      "4 blk/cell used 196 cached 0 free 531", "27.0% 196/727", "requests (6)", "4f34e33c…-0",
                      "q Quit", "a Abort request", "c Clear cache", "p Pause"):
                assert s in text, s
            bmap = app.main.query_one(BlockMap)
            assert bmap.blocks_per_cell == 4 and bmap.columns == 40 and len(bmap.cells) == 182
            top = next(i for i, line in enumerate(lines) if "KV blocks" in line)
            grid = [lines[top + 1 + r][1:41] for r in range(5)]
            expected = "".join(mc.glyph(c) for c in bmap.cells)
            assert "".join(grid)[:182] == expected
            assert grid[0][:10] == "····▄▆··▄█"  # blocks 0..39: null, free 1..17, used 18..22, free, used 34..
            sel = app.main.query_one(RequestTable).selected_id
            held = {b // 4 for b in next(r for r in load("busy")["requests"] if r["id"] == sel)["block_table"]}
            assert {i for i, c in enumerate(bmap.cells) if c.selected} == held
            assert expected.count("◆") == len(held)

    asyncio.run(go())


def test_table_sorts_and_selection_highlights_blocks():
    async def go():
        app = TopApp(FakeClient(load("busy")), interval=1000)
        async with app.run_test(size=(100, 30)) as pilot:
            await app.workers.wait_for_complete()
            table = app.main.query_one(RequestTable)
            assert table.row_ids == sorted(table.row_ids)
            assert table.selected_id == SELECTED_ID == table.row_ids[0]
            await pilot.press(*"sssss")  # id → state → prompt → cached → gen → blocks
            assert (table.sort_key, table.sort_reverse) == ("blocks", False)
            assert table.row_ids[-1] == SELECTED_ID and table.selected_id == SELECTED_ID  # the cursor follows
            await pilot.press("r")
            assert (table.sort_key, table.sort_reverse) == ("blocks", True)
            assert table.row_ids[0] == SELECTED_ID and table.cursor_row == 0
            await poll(app, pilot)  # the order and the cursor survive an update
            assert table.row_ids[0] == SELECTED_ID and table.selected_id == SELECTED_ID
            assert "BLOCKS▼" in "\n".join(screen_lines(app))
            bmap = app.main.query_one(BlockMap)
            k = bmap.blocks_per_cell
            table_blocks = next(r for r in load("busy")["requests"] if r["id"] == SELECTED_ID)["block_table"]
            assert {i for i, c in enumerate(bmap.cells) if c.selected} == {b // k for b in table_blocks}
            await pilot.press("down")  # the highlight moves to the next request's blocks
            nxt = next(r for r in load("busy")["requests"] if r["id"] == table.row_ids[1])
            assert table.selected_id == nxt["id"]
            assert {i for i, c in enumerate(bmap.cells) if c.selected} == {b // k for b in nxt["block_table"]}
            await pilot.click(RequestTable, offset=(26, 1))  # the PROMPT header
            assert table.sort_key == "prompt"

    asyncio.run(go())


def test_actions_call_the_client():
    async def go():
        fake = FakeClient(load("busy"))
        app = TopApp(fake, interval=1000)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.workers.wait_for_complete()
            await pilot.press("down", "a")
            await app.workers.wait_for_complete()
            assert ("abort", app.main.query_one(RequestTable).row_ids[1]) in fake.calls
            assert app.messages[-1].endswith("done")
            fake.fail = ApiResponseError(404, {"error": {"message": "no live request with id 'x'"}})
            await pilot.press("a")
            await app.workers.wait_for_complete()
            assert "failed: 404 no live request" in app.messages[-1]
            await pilot.press("c")
            assert isinstance(app.screen, ConfirmScreen)
            n_aborts = len([c for c in fake.calls if c[0] == "abort"])
            await pilot.press("a", "s")  # the dashboard's keys do nothing under the dialog
            await app.workers.wait_for_complete()
            assert len([c for c in fake.calls if c[0] == "abort"]) == n_aborts
            assert app.main.query_one(RequestTable).sort_key == "id"
            await pilot.press("n")
            assert ("reset_prefix_cache",) not in fake.calls and not isinstance(app.screen, ConfirmScreen)
            await pilot.press("c", "y")
            await app.workers.wait_for_complete()
            assert fake.calls.count(("reset_prefix_cache",)) == 1
            assert app.messages[-1] == "clear prefix cache: done (3 cached blocks dropped)"
            await pilot.press("p")
            n = len(fake.calls)
            app._tick()
            await pilot.pause()
            assert len(fake.calls) == n and "paused" in "\n".join(screen_lines(app))
            await pilot.press("p")
            await app.workers.wait_for_complete()
            assert len(fake.calls) == n + 1 and app.kind == "live"

    asyncio.run(go())


def test_down_reconnect_restart_and_version_mismatch_render():
    async def go():
        fake = FakeClient(DaemonUnavailable("no llmd daemon on /tmp/llmd-fake.sock (No such file or directory)"))
        app = TopApp(fake, interval=1000, clock=lambda: 0.0)  # a frozen clock: notices stay up
        async with app.run_test(size=(80, 24)) as pilot:
            await app.workers.wait_for_complete()
            await pilot.pause()

            def shown() -> str:
                return "\n".join(screen_lines(app))

            assert app.kind == "down" and "no llmd daemon on /tmp/llmd-fake.sock" in shown()
            steps = [
                (load("busy"), "live", "live:"),
                (ConnectionResetError(104, "reset"), "down", "daemon down or restarting"),
                (DaemonUnavailable("gone"), "down", "daemon down; retrying every 1000 s"),
                (dict(load("idle"), uptime_s=3.0), "notice", "daemon restarted: history cleared"),
                (dict(load("idle"), schema_version=2), "mismatch", "stats schema 2"),
                (dict(load("idle")), "notice", "reconnected"),
                ({"schema_version": STATS_SCHEMA_VERSION}, "notice", "reconnected"),  # every field missing
                ("<html>", "mismatch", "not a JSON object"),
                (ApiResponseError(500, {"error": {"message": "boom"}}), "error", "daemon answered 500: boom"),
                (future_payload(), "notice", "1 full + 5 × 512"),
            ]
            for answer, kind, text in steps:
                fake.answer = answer
                await poll(app, pilot)
                assert app.kind == kind and text in shown(), (answer, app.kind, app.message)
            assert app.main.has_class("stale") is False
            st = future_payload()
            assert "○" in "".join(mc.glyph(c) for c in app.main.query_one(BlockMap).cells)
            assert "KV mem 512 MiB" in shown() and "46,080" in shown()
            assert st["prefix_cache"]["hits"] / st["prefix_cache"]["queries"] == app.history.hit_rate_total()

    asyncio.run(go())


def mutations(payload, path=()):
    """(path, payload with the field at ``path`` removed / None / a string / a list) for every dict key."""
    cur = payload
    for k in path:
        cur = cur[k]
    if isinstance(cur, list):
        if cur and isinstance(cur[0], (dict, list)):
            yield from mutations(payload, path + (0,))
        return
    if not isinstance(cur, dict):
        return
    for key in list(cur):
        for bad in (KeyError, None, "x", [7]):
            out = copy.deepcopy(payload)
            parent = out
            for k in path:
                parent = parent[k]
            if bad is KeyError:
                del parent[key]
            else:
                parent[key] = bad
            yield path + (key,), out
        yield from mutations(payload, path + (key,))


def test_no_field_missing_or_mistyped_crashes_the_dashboard():
    async def go():
        fake = FakeClient(load("busy"))
        app = TopApp(fake, interval=1000)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.workers.wait_for_complete()
            n = 0
            for n, (path, bad) in enumerate(mutations(future_payload()), 1):
                app._received(bad)
                app.main.query_one(BlockMap).render()  # widgets render lazily: draw the map now
                app.main.query_one(HeaderBar).render()
                if n % 25 == 0:  # and the whole screen now and then
                    await pilot.pause()
            assert n > 200 and app.is_running
            fake.answer = load("busy")
            await poll(app, pilot)
            assert app.kind in ("live", "notice") and "requests (6)" in "\n".join(screen_lines(app))

    asyncio.run(go())
