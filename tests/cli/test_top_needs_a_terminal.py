"""``llmd top`` with stdout not a terminal (a file, a pipe; click's runner) refuses in one line and
exits 1; it drew the dashboard's escape codes into the file and retried every second forever."""

from __future__ import annotations

from click.testing import CliRunner
from serve_cli import one_error_line

from llmd.daemon.cli.main import main


def test_top_refuses_without_a_terminal(monkeypatch, tmp_path):
    import llmd.tui.app

    ran = []
    monkeypatch.setattr(llmd.tui.app.TopApp, "run", lambda self, *a, **kw: ran.append(self))  # never draws here
    result = CliRunner().invoke(main, ["top", "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 1 and not ran, (result.output, result.exception)
    one_error_line(result.output, "llmd top needs a terminal (stdout is not a TTY); use `llmd status` or `llmd ps`")
    assert result.output.count("\n") == 1 and "\x1b" not in result.output
