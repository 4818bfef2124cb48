"""The block map as data: run-length block states → grid cells of ``k`` blocks each (no Textual).

The daemon's ``/v1/stats`` block map is run-length encoded over block ids ``0..N-1`` with
states ``"null"`` (the reserved block 0), ``"free"``, ``"cached"`` (free but holding a
prefix-cache entry: cached and evictable) and ``"used"`` (ref_cnt > 0). :func:`aggregate`
folds it into cells of exactly ``k`` consecutive blocks (the last cell may be shorter) and
counts each state per cell, so the dashboard shades a cell by the fraction in each state.
Unknown states count as in use (never hidden). Cost O(runs + cells).

Which KV cache group holds a used block is not in the block map; :func:`block_groups` reads
it from the live requests' block tables (a flat list for one group, a list of lists for
several), and :func:`blocks_of` gives one request's blocks for highlighting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator

# Glyphs (the map must read without colour): in-use height ramp, cached, free, null.
USED_RAMP = "▁▂▃▄▅▆▇█"
CACHED_GLYPH = "○"
FREE_GLYPH = "·"
NULL_GLYPH = "×"
SELECTED_GLYPH = "◆"
STATE_ALIASES = {"used": "used", "cached": "cached", "free": "free", "null": "null"}


@dataclass
class Cell:
    """Counts of block states in one cell covering block ids ``[start, start + count)``."""

    start: int
    count: int
    used: int = 0
    cached: int = 0
    free: int = 0
    null: int = 0
    groups: dict[int, int] = field(default_factory=dict)  # used blocks per KV cache group index
    selected: bool = False  # holds a block of the selected request

    @property
    def real(self) -> int:
        """Blocks in the cell other than the null block."""
        return self.count - self.null

    def fraction(self, state: str) -> float:
        """Share (0..1) of the cell's non-null blocks that are in ``state``."""
        return getattr(self, state) / self.real if self.real else 0.0

    def dominant_group(self) -> int | None:
        """The KV cache group holding most of the cell's attributed used blocks (None: unknown)."""
        return max(self.groups, key=lambda g: (self.groups[g], -g)) if self.groups else None


def normalize_state(state) -> str:
    """Map a wire state to one of used/cached/free/null; anything unknown counts as used."""
    return STATE_ALIASES.get(str(state).lower(), "used")


def blocks_per_cell(num_blocks: int, capacity: int) -> int:
    """Smallest ``k`` such that ``num_blocks`` blocks in cells of ``k`` fit in ``capacity`` cells."""
    if num_blocks <= 0:
        return 1
    return max(1, math.ceil(num_blocks / max(1, capacity)))


def aggregate(runs: Iterable, k: int) -> list[Cell]:
    """Fold RLE ``[[state, count], ...]`` into cells of ``k`` blocks with per-state counts."""
    k = max(1, int(k))
    cells: list[Cell] = []
    pos = 0
    for run in runs:
        try:
            state, n = normalize_state(run[0]), int(run[1])
        except (TypeError, ValueError, IndexError):
            continue
        while n > 0:
            idx, off = divmod(pos, k)
            if idx == len(cells):
                cells.append(Cell(start=idx * k, count=0))
            take = min(n, k - off)
            cell = cells[idx]
            cell.count += take
            setattr(cell, state, getattr(cell, state) + take)
            pos += take
            n -= take
    return cells


def iter_block_table(table) -> Iterator[tuple[int, int]]:
    """Yield ``(group index, block id)`` from a flat block table or a list of per-group tables."""
    if not isinstance(table, list):
        return
    if table and all(isinstance(t, list) for t in table):
        for g, sub in enumerate(table):
            for b in sub:
                if isinstance(b, int) and b > 0:
                    yield g, b
        return
    for b in table:
        if isinstance(b, int) and b > 0:  # 0 is the null block (e.g. a slid-out window)
            yield 0, b


def request_tables(req: dict):
    """A request's block table(s): ``block_tables`` (per group) when sent, else ``block_table``."""
    tables = req.get("block_tables")
    return tables if isinstance(tables, list) else req.get("block_table")


def block_groups(requests: list) -> dict[int, int]:
    """Block id → KV cache group index for every block some live request holds."""
    out: dict[int, int] = {}
    for req in requests if isinstance(requests, list) else ():
        if isinstance(req, dict):
            for g, b in iter_block_table(request_tables(req)):
                out.setdefault(b, g)
    return out


def blocks_of(requests: list, request_id) -> set[int]:
    """The block ids held by the request ``request_id`` (empty when it is not live)."""
    for req in requests if isinstance(requests, list) else ():
        if isinstance(req, dict) and req.get("id") == request_id:
            return {b for _, b in iter_block_table(request_tables(req))}
    return set()


def annotate(cells: list[Cell], k: int, groups: dict[int, int], selected: set[int]) -> None:
    """Attribute cells' blocks to KV cache groups and mark cells holding ``selected`` blocks."""
    for b, g in groups.items():
        idx = b // k
        if 0 <= idx < len(cells):
            cells[idx].groups[g] = cells[idx].groups.get(g, 0) + 1
    for b in selected:
        idx = b // k
        if 0 <= idx < len(cells):
            cells[idx].selected = True


def glyph(cell: Cell) -> str:
    """One character for a cell: selected, else in-use height by fraction, else cached, free or null."""
    if cell.selected:
        return SELECTED_GLYPH
    if cell.real <= 0:
        return NULL_GLYPH
    if cell.used:
        level = math.ceil(cell.fraction("used") * len(USED_RAMP)) - 1
        return USED_RAMP[max(0, min(len(USED_RAMP) - 1, level))]
    if cell.cached:
        return CACHED_GLYPH
    return FREE_GLYPH


def totals(runs: Iterable) -> dict[str, int]:
    """Blocks per state over the whole map (used, cached, free, null)."""
    out = {"used": 0, "cached": 0, "free": 0, "null": 0}
    for run in runs:
        try:
            out[normalize_state(run[0])] += int(run[1])
        except (TypeError, ValueError, IndexError):
            continue
    return out
