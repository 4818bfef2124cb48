"""The rates widget: sparklines of prompt and generation tokens/s and running/waiting requests."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline

from llmd.tui.history import History

# (Sample field, label, number format)
SERIES = [("prompt_tps", "prompt tok/s", "{:7.1f}"), ("gen_tps", "gen tok/s", "{:7.1f}"),
          ("running", "running", "{:7.0f}"), ("waiting", "waiting", "{:7.0f}")]
POINTS = 120


def spark_data(vals: list[float]) -> list[float]:
    """What the sparkline draws for ``vals``. Textual scales bars from the data's minimum to its
    maximum, so a constant series would sit at the bottom like zero: a constant non-zero one is
    handed over as one point (drawn as full bars), one point ``v`` or none as ``[0, v]`` / ``[0]``."""
    if vals and min(vals) == max(vals) != 0:
        return vals[-1:]
    return vals if len(vals) > 1 else [0.0] + vals


class Rates(Vertical):
    """One row per series: a label with the latest value, then its sparkline."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._shown: dict[str, tuple] = {}

    def compose(self) -> ComposeResult:
        """A label and a sparkline per series in :data:`SERIES`."""
        for key, _, _ in SERIES:
            with Horizontal(classes="rate-row"):
                yield Label("", id=f"rate-label-{key}", classes="rate-label")
                yield Sparkline([], id=f"rate-spark-{key}", classes="rate-spark")

    def show(self, history: History) -> None:
        """Update every label and sparkline from ``history`` (latest value and last points)."""
        width = max(4, self.size.width - 20)
        for key, label, fmt in SERIES:
            vals = history.series(key, min(POINTS, width))
            latest = fmt.format(vals[-1]) if vals else "      -"
            text, data = f"{label:<12}{latest}", spark_data(vals)
            if self._shown.get(key) != text:  # repaint only on change (a label update re-lays out)
                self._shown[key] = text
                self.query_one(f"#rate-label-{key}", Label).update(text)
            spark = self.query_one(f"#rate-spark-{key}", Sparkline)
            if spark.data != data:
                spark.data = data
