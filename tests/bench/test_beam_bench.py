"""`llmd bench beam` on the tiny engine: shared beams hold fewer blocks than copied beams and
than independent sequences (the issue's >= 35 % at a 64 + 32-token beam of width 4), the
table names the three runs, and prefix caching on is refused."""

import pytest
from tiny_engine import tiny_engine

from llmd.daemon.bench.beam import TARGET, measure_beam_blocks, run_beam_bench


def test_beam_bench_figures(tmp_path):
    engine = tiny_engine(tmp_path / "tiny.gguf", enable_prefix_caching=False)
    lines = []
    r = run_beam_bench(engine, 64, 32, 4, echo=lines.append)
    bs = r["block_size"]
    assert r["independent"] == 4 * -(-(64 + 32) // bs)  # four sequences of 96 tokens, nothing shared
    assert r["shared"] < r["copied"] and r["saved_vs_independent"] >= TARGET, r
    assert "shared blocks" in lines[2] and "blocks copied" in lines[3] and "independent" in lines[4]
    assert engine.kv_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="prefix caching off"):
        measure_beam_blocks(tiny_engine(tmp_path / "cached.gguf"), [1, 2, 3], 2, 4)
