"""``llmd chat`` asks for a context shift: a reply that would cross the context goes on instead of
the 400 a long history gets (the REPL, in process, on a tiny engine with a 64-token context)."""

from __future__ import annotations

from click.testing import CliRunner
from tiny_engine import tiny_engine


def test_chat_reply_crosses_the_context(tmp_path, monkeypatch):
    from llmd.daemon.cli import chat as chat_cli
    from llmd.daemon.cli.main import main

    engine = tiny_engine(tmp_path / "t.gguf", max_model_len=64)
    monkeypatch.setattr(chat_cli, "build_engine", lambda **kw: engine)
    monkeypatch.setattr(chat_cli, "check_chat_template", lambda model: None)
    result = CliRunner().invoke(main, ["chat", "--no-daemon", "--max-tokens", "100", "--seed", "1",
                                       "--repetition-penalty", "1.0"], input="tell me everything\n")
    assert result.exit_code == 0, result.output
    assert "[stopped at 100 tokens]" in result.output and "error" not in result.output, result.output
    assert engine.scheduler.num_context_shifts >= 1
