"""``llmd bench prefix`` compares prefix caching on and off itself (its "on" engine forces caching
on), so ``--no-prefix-caching`` there is refused in one line naming it, before any weights load;
it was accepted and did nothing."""

from __future__ import annotations

from click.testing import CliRunner
from serve_cli import one_error_line

from llmd.daemon.cli import bench_serving
from llmd.daemon.cli.main import main
from llmd.daemon.core.errors import LlmdError


def test_bench_prefix_refuses_no_prefix_caching(monkeypatch):
    def no_load(**kw):
        raise LlmdError(f"an engine was built (prefix caching {kw['enable_prefix_caching']})")

    monkeypatch.setattr(bench_serving, "build_engine", no_load)
    args = ["bench", "prefix", "--users", "1", "--turns", "1", "--system-tokens", "64"]
    result = CliRunner().invoke(main, [*args, "--no-prefix-caching"])
    assert result.exit_code == 1, (result.output, result.exception)
    one_error_line(result.output, "llmd bench prefix runs with prefix caching on and off itself; "
                                  "drop --no-prefix-caching")
    assert "engine was built" not in result.output
    for ok in ([], ["--enable-prefix-caching"]):  # the default, or said explicitly: the engine is built
        result = CliRunner().invoke(main, [*args, *ok])
        one_error_line(result.output, "an engine was built (prefix caching True)")
