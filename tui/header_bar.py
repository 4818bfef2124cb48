"""The header: model, KV dtype, block size, windows, KV memory, bytes/token, uptime; then the
connection status (live, paused, daemon down / restarted / of another schema version)."""

from __future__ import annotations

import textwrap

from rich.text import Text
from textual.widget import Widget

from llmd.tui.stats_view import header_fields

# status kind → (glyph, style); the glyph makes it readable without colour
STATUS = {
    "live": ("●", "bold green"),
    "connecting": ("…", "bold yellow"),
    "paused": ("‖", "bold yellow"),
    "notice": ("↻", "bold cyan"),
    "down": ("✖", "bold white on dark_red"),
    "mismatch": ("✖", "bold white on dark_red"),
    "error": ("!", "bold white on dark_red"),
}


def header_lines(stats: dict | None, width: int) -> list[Text]:
    """``llmd top`` and the header fields of ``stats``, packed into lines of at most ``width`` cells."""
    lines = [Text("llmd top", style="bold")]
    for label, value in header_fields(stats or {}):
        item = Text.assemble((f"{label} ", "dim"), (value, "bold"))
        if lines[-1].cell_len + 2 + item.cell_len > width:
            lines.append(item)
        else:
            lines[-1].append("  ")
            lines[-1].append_text(item)
    return lines


def status_lines(kind: str, message: str, width: int) -> list[Text]:
    """The connection status, wrapped to ``width``; the glyph tells the state without colour."""
    glyph, style = STATUS.get(kind, STATUS["error"])
    parts = textwrap.wrap(message, max(10, width - 4)) or [""]
    return [Text(f" {glyph if i == 0 else ' '} {p} ", style=style) for i, p in enumerate(parts)]


class HeaderBar(Widget):
    """Header fields (as many lines as the width needs) and the status line.

    Renders itself (no ``Static.update``) and changes its height only when the number of lines
    changes, so the per-second uptime tick repaints this widget alone, not the whole screen.
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.stats: dict | None = None
        self.kind, self.message = "connecting", "connecting…"
        self._shown = None

    def show(self, stats: dict | None, kind: str, message: str) -> None:
        """Re-render with the latest stats (may be stale) and the connection status."""
        self.stats, self.kind, self.message = stats, kind, message
        self._fit()

    def _lines(self) -> list[Text]:
        width = max(20, self.size.width)
        return header_lines(self.stats, width) + status_lines(self.kind, self.message, width)

    def _fit(self) -> None:
        lines = self._lines()
        shown = [str(t) for t in lines]
        if shown == self._shown:
            return  # nothing changed: no repaint
        self._shown = shown
        if self.styles.height is None or self.styles.height.value != len(lines):
            self.styles.height = len(lines)
        self.refresh()

    def on_resize(self) -> None:
        """Re-pack the fields for the new width."""
        self._shown = None
        self._fit()

    def render(self) -> Text:
        """The header lines, then the status line(s)."""
        return Text("\n").join(self._lines())
