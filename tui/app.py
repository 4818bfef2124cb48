"""``llmd top``: the Textual app that polls ``/v1/stats`` and drives the main screen.

Data comes from a :class:`llmd.daemon.client.Client` (or anything with ``stats()``,
``abort(request_id)`` and ``reset_prefix_cache()``), called in a worker thread so a slow or
hung daemon never freezes the screen. Every poll that fails (no daemon, a restart, another
stats schema version, a malformed answer) shows a status line and the next tick retries:
the dashboard never exits on its own.
"""

from __future__ import annotations

import asyncio
import time

from textual.app import App
from textual.binding import Binding

from llmd.tui.confirm_screen import ConfirmScreen
from llmd.tui.history import History
from llmd.tui.main_screen import MainScreen
from llmd.tui.request_table import RequestTable
from llmd.tui.stats_view import short_id, version_problem

NOTICE_S = 5.0


class TopApp(App):
    """The dashboard. ``interval``: seconds between polls; ``clock``: monotonic time source."""

    CSS_PATH = "llmd.tcss"
    TITLE = "llmd top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        Binding("a", "abort", "Abort request"),
        Binding("c", "clear_cache", "Clear cache"),
        Binding("p", "toggle_pause", "Pause"),
        Binding("s", "cycle_sort", "Sort"),
        Binding("r", "reverse_sort", "Reverse"),
    ]

    def __init__(self, client, interval: float = 1.0, clock=time.monotonic):
        super().__init__()
        self.client = client
        self.interval = interval
        self.clock = clock
        self.history = History()
        self.paused = False
        self.kind, self.message = "connecting", "connecting…"
        self.ever_connected = False
        self.failures = 0
        self.notice_until = 0.0
        self.messages: list[str] = []  # results of actions, newest last (also shown as toasts)
        self._polling = False

    @property
    def where(self) -> str:
        """The socket path, for messages."""
        return str(getattr(self.client, "socket_path", "the daemon socket"))

    def on_mount(self) -> None:
        """Show the main screen, poll now and every ``interval`` seconds."""
        self.push_screen(MainScreen())
        self.set_interval(self.interval, self._tick)
        self._tick()

    @property
    def main(self) -> MainScreen:
        """The main screen (under the confirmation modal when that is open)."""
        return next(s for s in self.screen_stack if isinstance(s, MainScreen))

    def _tick(self) -> None:
        if self.paused or self._polling:
            return
        self._polling = True
        self.run_worker(self.poll_now(), group="poll", exit_on_error=False)

    async def poll_now(self) -> None:
        """Fetch one stats payload and render it, or render why there is none."""
        self._polling = True
        try:
            stats = await asyncio.to_thread(self.client.stats)
        except Exception as e:  # never crash on a poll: show it and retry next tick
            self._failed(e)
        else:
            self._received(stats)
        finally:
            self._polling = False

    def _failed(self, e: Exception) -> None:
        from llmd.daemon.client.client import ApiResponseError, DaemonStarting, DaemonUnavailable

        self.failures += 1
        retry = f"retrying every {self.interval:g} s (attempt {self.failures})"
        if isinstance(e, DaemonStarting):  # its lock is held, its socket not up yet: no "start one"
            self._status("down", f"the llmd daemon on {self.where} (pid {e.pid}) is starting ({retry})")
        elif isinstance(e, DaemonUnavailable):
            lead = ("daemon down" if self.ever_connected
                    else f"no llmd daemon on {self.where}; start one with `llmd serve`")
            self._status("down", f"{lead}; {retry}" if self.ever_connected else f"{lead} ({retry})")
        elif isinstance(e, ApiResponseError):
            self._status("error", f"daemon answered {e.status}: {e.message}; {retry}")
        elif isinstance(e, (ConnectionError, OSError)) or type(e).__module__ == "http.client":
            self._status("down", f"daemon down or restarting ({type(e).__name__}); {retry}")
        else:
            self._status("error", f"unreadable stats ({type(e).__name__}: {e}); {retry}")

    def _received(self, stats) -> None:
        problem = version_problem(stats)
        if problem:
            self.failures += 1
            self._status("mismatch", problem)
            return
        was_down, self.failures = self.kind in ("down", "error", "mismatch") and self.ever_connected, 0
        self.ever_connected = True
        now = self.clock()
        self.history.add(stats, now)
        if self.history.restarted or was_down:
            what = "daemon restarted: history cleared" if self.history.restarted else "reconnected"
            self.notice_until = now + NOTICE_S
            self.kind, self.message = "notice", what
        if self.kind == "notice" and now < self.notice_until:
            self._status("notice", self.message, stats)
        else:
            self._status("live", f"live: {self.where}, every {self.interval:g} s", stats)

    def _status(self, kind: str, message: str, stats: dict | None = None) -> None:
        self.kind, self.message = kind, message
        if self.paused and kind in ("live", "notice"):
            kind, message = "paused", "paused (p resumes)"
        if any(isinstance(s, MainScreen) for s in self.screen_stack):
            self.main.show(stats, self.history, kind, message)

    # ---- actions --------------------------------------------------------------------
    def _say(self, text: str, error: bool = False) -> None:
        self.messages.append(text)
        self.notify(text, severity="error" if error else "information", timeout=4)

    async def _call(self, what: str, fn, *args) -> None:
        """Run a client call in a thread; report its result; poll at once."""
        from llmd.daemon.client.client import ApiResponseError

        try:
            result = await asyncio.to_thread(fn, *args)
        except ApiResponseError as e:
            self._say(f"{what} failed: {e.status} {e.message}", error=True)
        except Exception as e:
            self._say(f"{what} failed: {type(e).__name__}: {e}", error=True)
        else:
            n = result.get("reset") if isinstance(result, dict) else None
            dropped = f" ({n} cached blocks dropped)" if isinstance(n, int) and not isinstance(n, bool) else ""
            self._say(f"{what}: done{dropped}")
        if not self.paused:
            await self.poll_now()

    def action_abort(self) -> None:
        """Abort the request under the table's cursor."""
        rid = self.main.query_one(RequestTable).selected_id
        if rid is None:
            self._say("no request selected", error=True)
            return
        self.run_worker(self._call(f"abort {short_id(rid, 16)}", self.client.abort, rid), group="action")

    def action_clear_cache(self) -> None:
        """Ask, then clear the daemon's prefix cache."""

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._call("clear prefix cache", self.client.reset_prefix_cache), group="action")
            else:
                self._say("prefix cache left as is")

        self.push_screen(ConfirmScreen("Clear the daemon's prefix cache? Cached blocks are evicted; "
                                       "running requests keep theirs."), answered)

    def action_toggle_pause(self) -> None:
        """Freeze or resume updates (the daemon is untouched)."""
        self.paused = not self.paused
        self._status(self.kind, self.message)
        if not self.paused:
            self._tick()

    def action_cycle_sort(self) -> None:
        """Sort the table by the next column."""
        self.main.query_one(RequestTable).cycle_sort()

    def action_reverse_sort(self) -> None:
        """Reverse the table's order."""
        table = self.main.query_one(RequestTable)
        table.sort_by(table.sort_key, not table.sort_reverse)
