"""The dashboard's main screen: header, block map, gauges and rates, request table, footer."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer

from llmd.tui.block_map import BlockMap
from llmd.tui.gauges import Gauges
from llmd.tui.header_bar import HeaderBar
from llmd.tui.history import History
from llmd.tui.rates import Rates
from llmd.tui.request_table import RequestTable
from llmd.tui.stats_view import get


class MainScreen(Screen):
    """Lays out the widgets; :meth:`show` pushes one stats payload (or a status) into all of them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.stats: dict | None = None
        self.ready = False

    def compose(self) -> ComposeResult:
        """Header, then the map beside gauges and rates, then the request table and the footer."""
        yield HeaderBar(id="header")
        with Horizontal(id="top"):
            with Vertical(id="map-panel"):
                yield BlockMap(id="block-map")
            with Vertical(id="side"):
                yield Gauges(id="gauges")
                yield Rates(id="rates")
        yield RequestTable(id="requests")
        yield Footer()

    def on_mount(self) -> None:
        """Titles and the focus on the table (its cursor selects a request)."""
        self.query_one("#map-panel").border_title = "KV blocks"
        self.query_one("#side").border_title = "cache & load"
        self.query_one(RequestTable).border_title = "requests"
        self.query_one(RequestTable).focus()
        self.ready = True
        app = self.app  # a poll may have answered before the widgets existed: show where it stands
        self.show(self.stats, getattr(app, "history", History()), getattr(app, "kind", "connecting"),
                  getattr(app, "message", "connecting…"))

    def show(self, stats: dict | None, history: History, kind: str, message: str) -> None:
        """Render ``stats`` (None: keep the last one, shown as stale) with the status line."""
        if stats is not None:
            self.stats = stats
        if not self.ready:
            return
        self.set_class(kind in ("down", "mismatch", "error"), "stale")
        table = self.query_one(RequestTable)
        self.query_one(HeaderBar).show(self.stats, kind, message)
        if stats is not None:
            table.show(stats)
            total = get(stats, "kv_cache", "total")
            title = f"KV blocks ({total} usable)" if total is not None else "KV blocks"
            _set_title(self.query_one("#map-panel"), title)
            _set_title(table, f"requests ({len(table.row_ids)})")
        self.query_one(BlockMap).show(self.stats, table.selected_id)
        self.query_one(Gauges).show(self.stats, history)
        self.query_one(Rates).show(history)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """Moving the cursor highlights that request's blocks in the map."""
        self.query_one(BlockMap).show(self.stats, self.query_one(RequestTable).selected_id)


def _set_title(widget, title: str) -> None:
    """Set a border title only when it changes (setting it repaints the widget)."""
    if widget.border_title != title:
        widget.border_title = title
