"""``llmd bench kv-transfer`` on a tiny engine (no timing asserted): both legs run over real
loopback TCP, the consumer imports every prompt's KV (the bench raises otherwise), and the
row's payload is the prompt's blocks of K/V; ``llmd serve --kv-role`` refuses what cannot work."""

from __future__ import annotations

from click.testing import CliRunner
from tiny_engine import tiny_engine

from llmd.daemon.bench.kv_transfer import run_kv_transfer_bench
from llmd.daemon.cli.main import main


def test_bench_rows_count_the_prompts_blocks(tmp_path):
    engines = []

    def make(first):
        engines.append(tiny_engine(tmp_path / "t.gguf"))
        return engines[-1]

    lines = []
    [row] = run_kv_transfer_bench(make, [40], repeats=1, echo=lines.append)
    eng = engines[0]
    blocks = -(-40 // eng.config.block_size)
    assert row["blocks"] == blocks
    assert round(row["mb"] * 1e6) == blocks * eng.block_bytes
    assert row["mb_per_s"] > 0 and row["consumer_leg_ms"] > 0 and "added ms/1k tok" in lines[1]


def test_serve_refuses_a_producer_without_a_listener(tmp_path):
    sock = str(tmp_path / "s.sock")
    out = CliRunner().invoke(main, ["serve", "--socket", sock, "--kv-role", "producer"])
    assert out.exit_code == 1 and "needs the TCP listener (--port)" in out.output
    out = CliRunner().invoke(main, ["serve", "--socket", sock, "--kv-role", "producer", "--host", "0.0.0.0",
                                    "--port", "1", "--api-key", "k"])
    assert out.exit_code == 1 and "--kv-advertise-host" in out.output
    out = CliRunner().invoke(main, ["serve", "--socket", sock, "--kv-role", "consumer", "--kv-pull-timeout", "0"])
    assert out.exit_code == 1 and "--kv-pull-timeout must be > 0" in out.output
