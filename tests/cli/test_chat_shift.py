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


def test_generate_truncate_prompt_tokens(tmp_path, monkeypatch):
    """``llmd generate --truncate-prompt-tokens N`` serves a prompt longer than the context by its
    last N tokens; without it the same prompt is one error line naming the opt-in."""
    from llmd.daemon.cli import generate as generate_cli
    from llmd.daemon.cli.main import main

    engine = tiny_engine(tmp_path / "g.gguf", max_model_len=32)
    monkeypatch.setattr(generate_cli, "build_engine", lambda **kw: engine)
    long = "The sea is wide and deep. " * 3
    ok = CliRunner().invoke(main, ["generate", "--max-tokens", "4", "--truncate-prompt-tokens", "20", long])
    assert ok.exit_code == 0 and "finish_reason=length" in ok.output, ok.output
    refused = CliRunner().invoke(main, ["generate", "--max-tokens", "4", long])
    assert refused.exit_code != 0 and "--truncate-prompt-tokens" in refused.output, refused.output


def test_status_counts_context_shifts(tmp_path, monkeypatch):
    """``llmd status``'s requests line names the daemon's context shifts once there are any (from
    ``/v1/stats`` ``scheduler.context_shifts``): a tiny engine's real stats after a shifting request."""
    from types import SimpleNamespace

    from llmd.daemon.cli import daemon as daemon_cli
    from llmd.daemon.cli.main import main
    from llmd.daemon.core.request import SamplingParams

    engine = tiny_engine(tmp_path / "s.gguf", max_model_len=64, context_overflow="shift")
    engine.add_request(list(range(40, 76)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    shifts = engine.scheduler.num_context_shifts
    assert shifts >= 1
    st = engine.make_stats().to_dict("tiny", 1.0)
    fake = SimpleNamespace(stats=lambda: st, health=lambda ready_only=True: {"status": "ok", "pid": 1},
                           socket_path="/tmp/x.sock")
    monkeypatch.setattr(daemon_cli, "client_for", lambda path: fake)
    out = CliRunner().invoke(main, ["status", "--socket", "/tmp/x.sock"]).output
    assert f"0 running, 0 waiting, {shifts} context shifts; " in out, out
    cached = st["kv_cache"]["cached_free"]  # the finished request's full blocks stay cached
    assert cached > 0 and f"0/{st['kv_cache']['total']} used (0.0%), {cached} free ones holding prefix-cache KV" in out


def test_status_of_a_loading_daemon(monkeypatch):
    """``llmd status`` while the daemon loads its model (``/health`` 503 ``loading``, ``/v1/stats``
    503): the daemon line says so and the command succeeds, instead of an error about a 503."""
    from types import SimpleNamespace

    from llmd.daemon.cli import daemon as daemon_cli
    from llmd.daemon.cli.main import main

    def stats():
        raise AssertionError("/v1/stats answers 503 while loading")
    body = {"status": "loading", "pid": 7, "model": "smollm2-135m", "model_ids": ["smollm2-135m"], "uptime_s": 3.2,
            "reason": "the model is loading"}  # daemon/serving/api.py health()'s body
    fake = SimpleNamespace(stats=stats, health=lambda ready_only=True: None if ready_only else body,
                           socket_path="/tmp/x.sock")
    monkeypatch.setattr(daemon_cli, "client_for", lambda path: fake)
    r = CliRunner().invoke(main, ["status", "--socket", "/tmp/x.sock"])
    assert r.exit_code == 0, r.output
    assert "(pid 7), up 3 s, loading the model" in r.output and "model:       smollm2-135m" in r.output, r.output
