"""The gauges widget: KV usage per cache group, prefix-cache hit rate, preemptions."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.widgets import Static

from llmd.tui.block_map import group_color
from llmd.tui.history import History
from llmd.tui.stats_view import fmt_rate, get, groups, num

NAME_WIDTH = 9


def bar(fraction: float, width: int) -> str:
    """A text bar of ``width`` cells filled to ``fraction`` (eighths for the last cell)."""
    fraction = min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part and full < width else ""
    return ("█" * full + partial).ljust(width, "░")


def _group_name(g: dict, i: int) -> str:
    return str(get(g, "name", default=f"group {i}")).replace("_attention", "").replace("sliding_window", "swa")


def _usage(g: dict) -> float:
    used, total = num(g, "used"), num(g, "total")
    return num(g, "usage", default=used / total if total > 0 else 0.0)


def gauge_lines(stats: dict, history: History, width: int) -> Text:
    """The gauges as text: KV usage per cache group (two per line when there are more than two),
    then hit rates and preemptions."""
    out = Text(no_wrap=True, overflow="ellipsis")
    gs = groups(stats)
    if len(gs) <= 2:
        bar_w = max(4, width - NAME_WIDTH - 17)
        for i, g in enumerate(gs):
            used, total = get(g, "used", default="-"), get(g, "total", default="-")
            out.append(f"{_group_name(g, i)[:NAME_WIDTH]:<{NAME_WIDTH}}")
            out.append(bar(_usage(g), bar_w), Style(color=group_color(i)))
            out.append(f" {100 * _usage(g):5.1f}% {used}/{total}\n")
    else:  # compact: "name bar pct" twice per line
        half = max(14, width // 2)
        bar_w = max(3, half - 6 - 7)
        for i, g in enumerate(gs):
            out.append(f"{_group_name(g, i)[:5]:<6}")
            out.append(bar(_usage(g), bar_w), Style(color=group_color(i)))
            out.append(f"{100 * _usage(g):4.0f}%" + ("\n" if i % 2 or i == len(gs) - 1 else "  "))
    q, h = num(stats, "prefix_cache", "queries"), num(stats, "prefix_cache", "hits")
    out.append(f"{'hit rate':<{NAME_WIDTH}}")
    if get(stats, "prefix_cache", "enabled") is False:
        out.append("prefix caching off\n", style="dim")
        return _preemptions(out, stats)
    out.append(f"1m {fmt_rate(history.hit_rate_window())}", style="bold")
    out.append(f"  all {fmt_rate(history.hit_rate_total())}")
    detail = f" {h:,.0f}/{q:,.0f} tok"
    used = NAME_WIDTH + len(f"1m {fmt_rate(history.hit_rate_window())}  all {fmt_rate(history.hit_rate_total())}")
    out.append((detail if used + len(detail) <= width else "") + "\n", style="dim")
    return _preemptions(out, stats)


def _preemptions(out: Text, stats: dict) -> Text:
    out.append(f"{'preempt':<{NAME_WIDTH}}")
    out.append(f"{num(stats, 'counters', 'num_preemptions'):,.0f} total", style="bold")
    out.append(f", {num(stats, 'scheduler', 'preempted'):,.0f} now preempted")
    return out


class Gauges(Static):
    """Shows :func:`gauge_lines` for the latest stats; ``show(stats, history)`` updates it."""

    def show(self, stats: dict | None, history: History) -> None:
        """Re-render for ``stats`` (None: nothing yet)."""
        text = Text("no data yet", style="dim") if stats is None else gauge_lines(stats, history, self.size.width or 36)
        if text != getattr(self, "_shown", None):  # repaint only on change
            self._shown = text
            self.update(text)
