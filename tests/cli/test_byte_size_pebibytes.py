"""Byte sizes go up to 1 PiB (the README's words, :data:`MAX_BYTES`), and the PiB / PB units parse:
``llmd kv-size --memory 1PiB`` said "cannot parse byte size '1PiB'", and ``2PiB`` "cannot parse"
where ``1025TiB`` got the range message."""

from __future__ import annotations

from click.testing import CliRunner

from llmd.daemon.cli.main import main
from llmd.daemon.core.option_values import MAX_BYTES, parse_bytes
from llmd.daemon.protocol import fmt_bytes


def kv_size(memory: str):
    return CliRunner().invoke(main, ["kv-size", "--model", "random:llama-3-8b", "--memory", memory,
                                     "--context", "1024"])


def test_pebibytes_parse_up_to_the_limit():
    assert parse_bytes("1PiB") == 2**50 == MAX_BYTES and parse_bytes("0.5 pib") == 2**49
    assert parse_bytes("1PB") == 10**15 and parse_bytes("1.1pb") == 11 * 10**14
    result = kv_size("1PiB")
    assert result.exit_code == 0 and f"memory {2**50:,} B (1 PiB)" in result.output, result.output
    assert fmt_bytes(2**50) == "1 PiB" and fmt_bytes(1.5 * 2**40) == "1.5 TiB"


def test_past_one_pebibyte_is_the_range_error_in_every_unit():
    for memory in ("2PiB", "1.2PB", "1025TiB"):
        result = kv_size(memory)
        assert result.exit_code != 0 and f"byte size must be at most 1 PiB, got '{memory}'" in result.output, \
            result.output
    result = kv_size("1P")  # a bare prefix is no unit
    assert result.exit_code != 0 and "cannot parse byte size '1P'" in result.output, result.output


def test_serve_takes_a_pebibyte_kv_cache_memory_option(tmp_path):
    """`serve --kv-cache-memory 1PiB` gets past the option parser (the missing model is what
    stops it); `2PiB` is the range error."""
    model, sock = str(tmp_path / "none.gguf"), str(tmp_path / "x.sock")
    ok = CliRunner().invoke(main, ["serve", "--model", model, "--kv-cache-memory", "1PiB", "--socket", sock])
    assert ok.exit_code == 1 and "model file not found" in ok.output and "byte size" not in ok.output, ok.output
    too_big = CliRunner().invoke(main, ["serve", "--model", model, "--kv-cache-memory", "2PiB", "--socket", sock])
    assert too_big.exit_code == 2 and "byte size must be at most 1 PiB, got '2PiB'" in too_big.output, too_big.output
