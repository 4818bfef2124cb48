"""``llmd bench single``: one row per --weight-quant format (nf4 among them) on a tiny GGUF, and a
format that cannot run (bitsandbytes missing) refused in one line before the first row loads."""

import sys

import gguf
import torch
from click.testing import CliRunner
from tiny_engine import ByteTokenizer
from tiny_gguf import write_tiny_llama

from llmd.daemon.bench.single import single_stream
from llmd.daemon.cli.main import main
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.models.gguf_loader import load_model

ARGS = ["bench", "single", "--prompt", "8", "--decode", "2", "--repeats", "1", "--dtype", "bfloat16",
        "--threads", "1", "--device", "cpu", "--kv-cache-memory", "4MiB"]


def test_rows_per_format_with_nf4(tmp_path):
    """:func:`single_stream` over engines of a tiny GGUF (byte tokenizer; the CLI builds the same
    engines from ``--model``): one row per format, each with its weights line."""
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, qtype=gguf.GGMLQuantizationType.Q4_1)

    def make_engine(fmt):
        config = EngineConfig(model=str(path), dtype="bfloat16", device="cpu", threads=1, weight_quant=fmt,
                              kv_cache_memory=4 * 2**20).resolve()
        model, _ = load_model(str(path), torch.bfloat16, weight_quant=config.weight_quant)
        return Engine(model, ByteTokenizer(), config)

    lines = []
    rows = single_stream(make_engine, ["none", "gguf", "nf4"], prompt_len=8, decode=2, repeats=1, echo=lines.append)
    assert [r.weight_quant for r in rows] == ["none", "gguf", "nf4"] and len(lines) == 4
    assert all(r.prefill_tok_s > 0 and r.decode_tok_s > 0 for r in rows)
    assert rows[1].weights.startswith("weights gguf: 9 int4 + 0 int8 layers")
    assert rows[2].weights.startswith("weights nf4 (bitsandbytes, ") and " 9 nf4 layers" in rows[2].weights
    assert lines[1].split()[:1] == ["none"] and float(lines[1].split()[3]) == 1.0  # decode / first


def test_a_format_that_cannot_run_is_refused_before_any_row(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, qtype=gguf.GGMLQuantizationType.Q4_1)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises
    r = CliRunner().invoke(main, [*ARGS, "--model", str(path), "--formats", "none,nf4"])
    assert r.exit_code == 1 and "loading" not in r.output, r.output
    assert r.output.strip().splitlines()[-1].startswith("llmd: error: --formats nf4: nf4 needs bitsandbytes")
