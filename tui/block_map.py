"""The block map widget: the KV block pool as a grid of cells, a legend and totals.

Each cell is one block, or ``k`` consecutive blocks when the pool is larger than the grid
(``k`` is the smallest that fits). A cell's glyph says what it holds without colour
(in-use height ``▁…█`` by the fraction of its blocks in use, ``○`` cached and evictable,
``·`` free, ``×`` the null block, ``◆`` holds a block of the selected request); colour adds
the KV cache group of the in-use blocks and a blue background for the cached share.
"""

from __future__ import annotations

from rich.color import Color
from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from llmd.tui import map_cells as mc
from llmd.tui.stats_view import get, short_id

LEGEND_LINES = 2
GROUP_COLORS = ["#5fd75f", "#ffaf5f", "#af87ff", "#5fd7ff", "#ff5f87", "#d7d75f"]
CACHED_COLOR = "#6ca0dc"
FREE_COLOR = "#6c6c6c"
NULL_COLOR = "#444444"
BG = (28, 28, 28)
CACHED_BG = (29, 63, 115)
SELECTED = Style(color="#ffff5f", bgcolor="#875f00", bold=True)


def group_color(g: int | None) -> str:
    """The colour of KV cache group ``g`` (group 0's when unknown)."""
    return GROUP_COLORS[(g or 0) % len(GROUP_COLORS)]


def cell_style(cell: mc.Cell) -> Style:
    """Foreground by the cell's dominant content, background tinted by its cached share."""
    if cell.selected:
        return SELECTED
    if cell.real <= 0:
        fg = NULL_COLOR
    elif cell.used:
        fg = group_color(cell.dominant_group())
    elif cell.cached:
        fg = CACHED_COLOR
    else:
        fg = FREE_COLOR
    c = cell.fraction("cached") if cell.used else 0.0
    bg = tuple(round(a + (b - a) * c) for a, b in zip(BG, CACHED_BG))
    return Style(color=fg, bgcolor=Color.from_rgb(*bg))


class BlockMap(Widget):
    """Renders the last stats payload's block map to fit the widget; see the module docstring.

    After each render ``cells`` and ``blocks_per_cell`` describe what is on screen (tests read them).
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.stats: dict | None = None
        self.selected_id: str | None = None
        self.cells: list[mc.Cell] = []
        self.blocks_per_cell = 1
        self.columns = 1
        self.selected_text = ""
        self._drawn: str | None = None

    def show(self, stats: dict | None, selected_id: str | None = None) -> None:
        """Draw ``stats`` (None: nothing yet) highlighting ``selected_id``'s blocks."""
        reqs = get(stats, "requests", default=[])
        reqs = reqs if isinstance(reqs, list) else []
        key = repr((get(stats, "block_map"), [(r.get("id"), r.get("block_table"), r.get("block_tables"))
                                               for r in reqs if isinstance(r, dict)], selected_id))
        self.stats, self.selected_id = stats, selected_id
        if stats is not None and key == self._drawn:
            return  # nothing on the map changed: no repaint
        self._drawn = key if stats is not None else None
        held = mc.blocks_of(reqs, selected_id) if selected_id else set()
        self.selected_text = f"{mc.SELECTED_GLYPH} {short_id(selected_id)}: {len(held)} blocks" if held else ""
        if self.parent is not None:
            self.parent.border_subtitle = self.selected_text
        self.refresh()

    def layout_cells(self, width: int, height: int) -> list[mc.Cell]:
        """Aggregate the block map to fit a ``width`` × ``height`` grid; sets ``blocks_per_cell``."""
        runs = get(self.stats, "block_map", "runs", default=[])
        runs = runs if isinstance(runs, list) else []
        n = sum(mc.totals(runs).values())
        self.columns = max(1, width)
        self.blocks_per_cell = k = mc.blocks_per_cell(n, self.columns * max(1, height))
        cells = mc.aggregate(runs, k)
        reqs = get(self.stats, "requests", default=[])
        mc.annotate(cells, k, mc.block_groups(reqs), mc.blocks_of(reqs, self.selected_id))
        return cells

    def render(self) -> Text:
        """The grid rows, then the legend and the totals."""
        width, height = self.size.width, self.size.height
        if self.stats is None:
            return Text("waiting for the daemon…", style="dim")
        enc = get(self.stats, "block_map", "encoding", default="?")
        if enc != "rle":
            return Text(f"block map encoding {enc!r} not shown (llmd top reads run-length maps)", style="dim")
        grid_h = max(1, height - LEGEND_LINES)
        self.cells = self.layout_cells(width, grid_h)
        out = Text(no_wrap=True, overflow="crop")
        for i, cell in enumerate(self.cells):
            if i and i % self.columns == 0:
                out.append("\n")
            out.append(mc.glyph(cell), cell_style(cell))
        rows = -(-len(self.cells) // self.columns)
        out.append("\n" * max(1, grid_h - rows + (1 if rows else 0)))
        out.append_text(self.legend())
        return out

    def legend(self) -> Text:
        """Two lines: what each glyph means, then block counts and blocks per cell."""
        runs = get(self.stats, "block_map", "runs", default=[])
        t = mc.totals(runs if isinstance(runs, list) else [])
        k = self.blocks_per_cell
        legend = Text(no_wrap=True, overflow="crop")
        legend.append("█▄▁", Style(color=group_color(0)))
        legend.append(" in use  ")
        legend.append(mc.CACHED_GLYPH, Style(color=CACHED_COLOR))
        legend.append(" cached  ")
        legend.append(mc.FREE_GLYPH, Style(color=FREE_COLOR))
        legend.append(" free  ")
        legend.append(mc.NULL_GLYPH, Style(color=NULL_COLOR))
        legend.append(" null\n")
        legend.append(f"{k} blk/cell ", style="dim")
        legend.append(f"used {t['used']} cached {t['cached']} free {t['free']}")
        return legend
