"""The request table: live requests, sortable by any column, the cursor selecting one request."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from llmd.tui.stats_view import COLUMNS, cell_text, request_rows, sort_rows

KEYS = [key for key, _, _ in COLUMNS]


class RequestTable(DataTable):
    """A row per live request (row key = full request id); ``sort_by`` picks the order.

    The sort is re-applied on every update and the cursor stays on the same request id
    while it is live. Clicking a column header sorts by it (again: reverses).
    """

    def __init__(self, **kw):
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.sort_key = "id"
        self.sort_reverse = False
        self.row_ids: list[str] = []

    def on_mount(self) -> None:
        """Add the columns."""
        for key, label, width in COLUMNS:
            self.add_column(self._label(key, label), width=max(width, len(label) + 1), key=key)  # + sort arrow

    def _label(self, key: str, label: str) -> Text:
        if key != self.sort_key:
            return Text(label)
        return Text(label + ("▼" if self.sort_reverse else "▲"), style="bold")

    @property
    def selected_id(self) -> str | None:
        """The full id of the request under the cursor (None: empty table)."""
        if not self.row_ids or not 0 <= self.cursor_row < len(self.row_ids):
            return None
        return self.row_ids[self.cursor_row]

    def sort_by(self, key: str, reverse: bool | None = None) -> None:
        """Sort by column ``key``; ``reverse`` None flips the direction when ``key`` is already the sort key."""
        if key not in KEYS:
            return
        if reverse is None:
            reverse = (not self.sort_reverse) if key == self.sort_key else False
        self.sort_key, self.sort_reverse = key, reverse
        for k, label, _ in COLUMNS:
            self.columns[k].label = self._label(k, label)  # type: ignore[index]
        getattr(self, "_clear_caches", self.refresh)()  # DataTable caches the rendered header
        if self._last is not None:
            self.show(self._last)

    def cycle_sort(self) -> None:
        """Sort by the next column (ascending)."""
        self.sort_by(KEYS[(KEYS.index(self.sort_key) + 1) % len(KEYS)], reverse=False)

    _last: dict | None = None

    def show(self, stats: dict | None) -> None:
        """Replace the rows with ``stats``'s live requests, sorted, keeping the selected request."""
        self._last = stats
        keep = self.selected_id
        rows = sort_rows(request_rows(stats), self.sort_key, self.sort_reverse) if stats else []
        ids = [r["id"] for r in rows]
        widths = {key: width for key, _, width in COLUMNS}
        if ids != self.row_ids:
            self.clear()
            self.row_ids = ids
            for r in rows:
                self.add_row(*(cell_text(k, r[k], widths[k]) for k in KEYS), key=r["id"])
        else:
            for r in rows:
                for k in KEYS:
                    self.update_cell(r["id"], k, cell_text(k, r[k], widths[k]))
        if keep in ids and self.cursor_row != ids.index(keep):
            self.move_cursor(row=ids.index(keep), animate=False)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        """Header click: sort by that column."""
        event.stop()
        self.sort_by(str(event.column_key.value))
