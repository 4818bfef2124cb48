"""``llmd bench kv-quality --jitter-runs`` / ``--text long`` (issue 19): the jitter is real, seeded
and undone; the statistics are over the runs; the long text is long enough."""

from __future__ import annotations

import statistics

import pytest
import torch
from click.testing import CliRunner

from llmd.daemon.bench.kv_quality_runs import format_stats, jitter_runs, jittered_embedding
from llmd.daemon.bench.kv_quality_text import EXTRA_TEXT, LONG_QUALITY_TEXT, QUALITY_TEXT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_engine import tiny_engine

    return tiny_engine(tmp_path_factory.mktemp("jit") / "tiny.gguf")


def test_jitter_is_seeded_relative_and_restored(tiny):
    w = tiny.runner.model.embed_tokens.weight.data
    before = w.clone()
    with jittered_embedding(tiny.runner.model, 3):
        first = w.clone()
    assert torch.equal(w, before)  # undone bit for bit
    with jittered_embedding(tiny.runner.model, 3):
        assert torch.equal(w, first)  # the seed fixes the realization
    with jittered_embedding(tiny.runner.model, 4):
        assert not torch.equal(w, first)
    rel = ((first - before) / before)[before != 0].abs()
    assert 1e-7 < rel.mean().item() < 2e-6 and rel.max().item() < 1e-5  # ~1e-6 relative, not absolute


def test_jitter_refuses_16_bit_tables(tiny):
    model = tiny.runner.model
    saved = model.embed_tokens.weight.data
    model.embed_tokens.weight.data = saved.to(torch.bfloat16)
    try:
        with pytest.raises(ValueError, match="float32"):
            with jittered_embedding(model, 0):
                pass
    finally:
        model.embed_tokens.weight.data = saved


def test_runs_give_per_run_figures_and_spread(tiny):
    ids = tiny.input_processor.tokenize(QUALITY_TEXT[:300])
    kw = dict(device="cpu", dtype="float32", kv_cache_memory=4 * 2**20, attention_backend="torch", threads=1)
    stats = jitter_runs(tiny.runner.model, tiny.tokenizer, ids, 3, kv_dtypes=("auto", "int4"), chunk=32,
                        rotations=("none",), **kw)
    assert [s.label for s in stats] == ["auto", "int4"]
    auto, int4 = stats
    assert auto.delta_nll_pct == [0.0] * 3 and auto.top1_pct == [100.0] * 3  # each run vs its own auto run
    assert len(int4.delta_nll_pct) == 3 and len(set(int4.delta_nll_pct)) > 1  # the realizations differ
    lines = format_stats(stats)
    assert "3 runs" in lines[0]
    assert f"{statistics.fmean(int4.delta_nll_pct):.3f} ± {statistics.stdev(int4.delta_nll_pct):.3f}" in lines[2]
    with pytest.raises(ValueError, match=">= 1"):
        jitter_runs(tiny.runner.model, tiny.tokenizer, ids, 0, **kw)


def test_scale_groups_choose_the_rows(tiny):
    """``--scale-groups``: each 8-bit dtype once per group size (labels ``int8/g8``); int4, whose
    groups are its own, only when 0 is listed; bytes per token count each group's scale."""
    from llmd.daemon.bench.kv_quality import kv_quality

    ids = tiny.input_processor.tokenize(QUALITY_TEXT[:120])
    kw = dict(device="cpu", dtype="float32", kv_cache_memory=4 * 2**20, attention_backend="torch", threads=1,
              chunk=32, rotations=("none",))
    rows = kv_quality(tiny.runner.model, tiny.tokenizer, ids, ("auto", "int8", "int4"), scale_groups=(8,), **kw)
    assert [r.label for r in rows] == ["auto", "int8/g8"]
    assert rows[1].bytes_per_token == 2 * 2 * 2 * (16 + 2 * 4)  # 2 layers, 2 KV heads, head_dim 16, 2 scales
    both = kv_quality(tiny.runner.model, tiny.tokenizer, ids, ("auto", "int8", "int4"), scale_groups=(0, 8), **kw)
    assert [r.label for r in both] == ["auto", "int8", "int8/g8", "int4"]


def test_long_text_is_the_short_one_plus_original_prose():
    assert LONG_QUALITY_TEXT.startswith(QUALITY_TEXT) and LONG_QUALITY_TEXT.endswith(EXTRA_TEXT)
    assert len(LONG_QUALITY_TEXT.split()) > 1.9 * len(QUALITY_TEXT.split())  # ≥ 2,000 tokens on both models


def test_cli_refuses_jitter_outside_float32():
    from llmd.daemon.cli.main import main as cli

    res = CliRunner().invoke(cli, ["bench", "kv-quality", "--jitter-runs", "2", "--dtype", "bfloat16"])
    assert res.exit_code != 0 and "--jitter-runs needs --dtype float32" in res.output
    res = CliRunner().invoke(cli, ["bench", "kv-quality", "--jitter-runs", "-1"])
    assert res.exit_code != 0 and "--jitter-runs must be >= 0" in res.output
