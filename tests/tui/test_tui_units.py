"""The pure helpers of ``llmd top`` (no Textual): block map → cells and glyphs, block groups,
hit-rate history, defensive field access; fed with the recorded payloads of ``tests/fixtures/data``."""

from __future__ import annotations

import random

import pytest
from stats_payloads import expand, future_payload, load

from llmd.daemon.protocol import STATS_SCHEMA_VERSION
from llmd.tui import map_cells as mc
from llmd.tui.gauges import gauge_lines
from llmd.tui.history import History
from llmd.tui.stats_view import header_fields, request_rows, sort_rows, version_problem


def test_recorded_payloads_are_current_schema():
    for name in ("busy", "idle"):
        st = load(name)
        assert st["schema_version"] == STATS_SCHEMA_VERSION and version_problem(st) is None
        assert sum(n for _, n in st["block_map"]["runs"]) == st["kv_cache"]["num_blocks"]
    assert version_problem(dict(load("idle"), schema_version=2)).startswith("the daemon speaks stats schema 2")


def test_cells_one_block_each_match_states_and_glyphs():
    runs = load("busy")["block_map"]["runs"]
    cells = mc.aggregate(runs, 1)
    assert [c.start for c in cells] == list(range(728))
    glyphs = {"null": "×", "free": "·", "used": "█"}
    assert [mc.glyph(c) for c in cells] == [glyphs[s] for s in expand(runs)]
    assert mc.glyph(mc.aggregate([["cached", 1]], 1)[0]) == "○"
    assert mc.aggregate([["weird", 2]], 1)[0].used == 1  # unknown states count as in use


def test_cells_aggregate_a_pool_larger_than_the_grid():
    runs = load("busy")["block_map"]["runs"]
    k = mc.blocks_per_cell(728, 100)
    assert k == 8
    cells = mc.aggregate(runs, k)
    assert len(cells) == 91 and sum(c.count for c in cells) == 728
    states = expand(runs)
    for c in cells:
        chunk = states[c.start:c.start + k]
        assert (c.used, c.free, c.null, c.cached) == tuple(chunk.count(s) for s in ("used", "free", "null", "cached"))
    # blocks 16..23: 2 free, 5 used (18..22), 1 free → 5/8 in use → the 5th ramp step
    assert mc.glyph(cells[2]) == "▅" and mc.glyph(cells[0]) == "·" and mc.glyph(cells[7]) == "█"
    rng = random.Random(0)
    for _ in range(50):  # random maps, random k: counts match a brute-force expansion
        runs = [[rng.choice(["free", "used", "cached"]), rng.randint(1, 9)] for _ in range(rng.randint(1, 30))]
        k = rng.randint(1, 7)
        states = expand(runs)
        for c in mc.aggregate(runs, k):
            chunk = states[c.start:c.start + k]
            assert (c.used, c.free, c.cached, c.count) == (chunk.count("used"), chunk.count("free"),
                                                           chunk.count("cached"), len(chunk))


def test_block_groups_from_flat_and_per_group_tables():
    reqs = [{"id": "a", "block_table": [5, 6, 0]}, {"id": "b", "block_tables": [[7], [8, 9]]}, {"id": "c"}]
    assert mc.block_groups(reqs) == {5: 0, 6: 0, 7: 0, 8: 1, 9: 1}
    assert mc.blocks_of(reqs, "b") == {7, 8, 9} and mc.blocks_of(reqs, "zz") == set()
    cells = mc.aggregate([["null", 1], ["used", 9]], 4)
    mc.annotate(cells, 4, mc.block_groups(reqs), {9})
    assert cells[2].dominant_group() == 1 and cells[2].selected and not cells[1].selected


def test_history_hit_rates_and_restart():
    h = History()
    st = load("idle")
    for t, (q, hits) in enumerate([(0, 0), (100, 50), (200, 60)]):
        h.add(dict(st, prefix_cache={"queries": q, "hits": hits}, uptime_s=100 + 30 * t), 30.0 * t)
    assert h.hit_rate_total() == pytest.approx(0.3)
    assert h.hit_rate_window(60) == pytest.approx(0.3)  # base = the sample at t=0
    assert h.hit_rate_window(30) == pytest.approx(0.1)
    h.add(dict(st, prefix_cache={"queries": 10, "hits": 1}, uptime_s=5), 100.0)
    assert h.restarted and len(h.samples) == 1 and h.hit_rate_window() == pytest.approx(0.1)


def test_missing_fields_never_raise():
    assert dict(header_fields({}))["model"] == "-"
    assert request_rows({"requests": [{"id": "x"}, "junk"]})[0]["tps"] is None
    assert "n/a" in str(gauge_lines({}, History(), 36))
    rows = request_rows(load("busy"))
    assert [r["blocks"] for r in sort_rows(rows, "blocks", reverse=True)] == [81, 65, 43, 6, 1, 0]
    assert [r["ttft"] is None for r in sort_rows(rows, "ttft")][-1]  # unknown last
    text = str(gauge_lines(future_payload(), History(), 36))
    assert text.count("swa_") == 5 and "3 total" in text
