"""``llmd top`` details from issue 17's trial (pilot tests, no daemon): the clear-cache dialog
shows its whole question at 80×24 and 120×40, a constant non-zero rate is not drawn at the
bottom like zero, and with no daemon the header claims no attention windows."""

from __future__ import annotations

import asyncio

import pytest
from rich.console import Console
from stats_payloads import load
from test_tui import FakeClient, screen_lines

from llmd.daemon.client.client import DaemonStarting, DaemonUnavailable
from llmd.tui.app import TopApp
from llmd.tui.confirm_screen import ConfirmScreen
from llmd.tui.history import History
from llmd.tui.rates import Rates, spark_data


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_clear_cache_dialog_shows_the_whole_question(size):
    async def go():
        app = TopApp(FakeClient(load("busy")), interval=1000)
        async with app.run_test(size=size) as pilot:
            await app.workers.wait_for_complete()
            await pilot.press("c")
            await pilot.pause()
            assert isinstance(app.screen, ConfirmScreen)
            r = app.screen.query_one("#confirm-question").region
            assert r.right <= size[0] and r.bottom <= size[1]
            shown = [line[r.x:r.right] for line in screen_lines(app)[r.y:r.bottom]]
            assert " ".join(" ".join(shown).split()) == " ".join(app.screen.question.split()), shown
            box = app.screen.query_one("#confirm-box").region
            assert "Yes (y)" in "".join(screen_lines(app)[box.y:box.bottom])

    asyncio.run(go())


def test_constant_nonzero_rate_is_drawn_full_not_at_the_bottom():
    assert spark_data([5.0] * 30) == [5.0]  # one point: Textual draws it as full bars
    assert spark_data([0.0] * 30) == [0.0] * 30 and spark_data([]) == [0.0] and spark_data([3.0]) == [3.0]
    assert spark_data([1.0, 2.0]) == [1.0, 2.0]

    async def go():
        app = TopApp(FakeClient(load("busy")), interval=1000)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.workers.wait_for_complete()
            hist = History()
            busy = load("busy")
            for t in range(10):  # the same generation rate every second
                hist.add(dict(busy, uptime_s=100.0 + t), float(t))
            rates = app.main.query_one(Rates)
            rates.show(hist)
            await pilot.pause()
            spark = rates.query_one("#rate-spark-running")
            assert len(set(hist.series("running", 60))) == 1 and hist.series("running", 60)[-1] > 0
            drawn = Console(width=20, color_system=None).render_lines(spark.render(), pad=False)
            assert set("".join(seg.text for seg in drawn[0])) == {"█"}  # not "▁" (the bottom, like zero)

    asyncio.run(go())


def test_no_daemon_header_claims_no_windows():
    async def go():
        app = TopApp(FakeClient(DaemonUnavailable("no llmd daemon on /tmp/llmd-fake.sock")), interval=1000)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.workers.wait_for_complete()
            await pilot.pause()
            shown = "\n".join(screen_lines(app))
            assert app.kind == "down" and "no llmd daemon" in shown
            assert "windows" not in shown, shown

    asyncio.run(go())


def test_a_starting_daemon_is_named_not_start_one():
    """A daemon holding its lock without a socket yet: the status line says it is starting, not
    "no llmd daemon ...; start one with `llmd serve`"."""
    async def go():
        app = TopApp(FakeClient(DaemonStarting("/tmp/llmd-fake.sock", 4242)), interval=1000)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert app.kind == "down" and "start one" not in app.message, app.message
            assert app.message.startswith("the llmd daemon on /tmp/llmd-fake.sock (pid 4242) is starting"), app.message

    asyncio.run(go())
