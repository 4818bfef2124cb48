"""`llmd generate --beam-width K`: the K beams, best first (on the tiny engine), and a
one-line error for a combination beam search refuses, before any weights load."""

from click.testing import CliRunner
from tiny_engine import tiny_engine

import llmd.daemon.cli.generate as generate_cli
from llmd.daemon.cli.main import main


def test_generate_prints_every_beam(tmp_path, monkeypatch):
    engine = tiny_engine(tmp_path / "tiny.gguf")
    monkeypatch.setattr(generate_cli, "build_engine", lambda **kw: engine)
    result = CliRunner().invoke(main, ["generate", "hello", "--beam-width", "3", "--max-tokens", "5",
                                       "--length-penalty", "0", "--early-stopping", "true"])
    assert result.exit_code == 0, result.output
    beams = [line for line in result.output.splitlines() if line.startswith("[beam ")]
    assert [b.split(",")[0] for b in beams] == ["[beam 0", "[beam 1", "[beam 2"]
    assert len({b.split("] ", 1)[1] for b in beams}) == 3  # three distinct continuations
    assert "15 tokens" in result.output and engine.kv_manager.num_used_blocks == 0


def test_generate_beam_refuses_temperature_in_one_line(monkeypatch):
    def no_load(**kw):
        raise AssertionError("weights loaded before the check")

    monkeypatch.setattr(generate_cli, "build_engine", no_load)
    result = CliRunner().invoke(main, ["generate", "hi", "--beam-width", "2", "--temperature", "0.5"])
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("llmd: error: ") and "temperature must be 0" in last, result.output
    # in the CLI's words: its flags, not the API's fields (there is no --use-beam-search or --stop-token-ids)
    assert last == "llmd: error: beam search (--beam-width) is greedy: --temperature must be 0, got 0.5", last
    stop = CliRunner().invoke(main, ["generate", "hi", "--beam-width", "2", "--stop", "x"])
    assert stop.output.strip().splitlines()[-1] == \
        "llmd: error: --stop strings are not supported with beam search (--beam-width)", stop.output
