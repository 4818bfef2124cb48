"""``llmd kv-size``'s option values: one line ``llmd: error: ...`` in the words ``llmd generate`` /
``llmd serve`` use for the same options (they were ZeroDivisionError tracebacks, negative block
counts, or a silent fallback), and ``--context`` capped at the model's context as ``--max-model-len``
is. A ``random:`` preset's shapes only: no GGUF file, no weights."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from llmd.daemon.cli.main import main
from llmd.daemon.core.kv_size import KV_SIZE_ROWS, MIN_KV_BLOCKS, kv_cache_block_bytes, kv_residual_bytes
from llmd.daemon.kv import make_kv_cache_groups
from llmd.models.presets import preset_config

MODEL = "random:llama-3-8b"  # an 8,192-token context, 32 layers, 8 KV heads x 128


def run_kv_size(*args: str):
    return CliRunner().invoke(main, ["kv-size", "--model", MODEL, *args])


def assert_one_line_error(result, text: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.output.strip().splitlines() == [f"llmd: error: {text}"], result.output


def smallest_need(block_size: int = 16, max_num_seqs: int = 64) -> tuple[int, int]:
    """(bytes of 2 blocks plus int4's residual, the block) of the format that needs the least."""
    cfg = preset_config(MODEL)
    groups = make_kv_cache_groups(cfg.layer_windows, True)
    return min((kv_residual_bytes(cfg, groups, block_size, kv, max_num_seqs)
                + MIN_KV_BLOCKS * (b := kv_cache_block_bytes(cfg, groups, block_size, kv, dt)), b)
               for _, kv, dt in KV_SIZE_ROWS)


def block_bytes(name: str, block_size: int = 16) -> int:
    cfg = preset_config(MODEL)
    groups = make_kv_cache_groups(cfg.layer_windows, True)
    return next(kv_cache_block_bytes(cfg, groups, block_size, kv, dt) for n, kv, dt in KV_SIZE_ROWS if n == name)


@pytest.mark.parametrize("args, text", [
    (["--context", "-5"], "--context must be >= 1, got -5"),  # was ZeroDivisionError
    (["--context", "0"], "--context must be >= 1, got 0"),  # was the model's 8192, silently
    (["--block-size", "0"], "--block-size must be >= 1, got 0"),  # was ZeroDivisionError
    (["--block-size", "-16"], "--block-size must be >= 1, got -16"),  # was exit 0, negative blocks
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--max-num-seqs", "-1"], "--max-num-seqs must be >= 1, got -1"),
    (["--context", "0", "--total-memory", "1GiB"], "--context must be >= 1, got 0"),  # the --total-memory path too
])
def test_counts_below_one_are_one_line_errors(args, text):
    assert_one_line_error(run_kv_size(*args), text)


def test_counts_are_checked_before_the_model_resolves(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    result = CliRunner().invoke(main, ["kv-size", "--model", missing, "--block-size", "0"])
    assert_one_line_error(result, "--block-size must be >= 1, got 0")


def test_memory_below_the_engines_two_blocks_is_one_line_error():
    """The engine's minimum and words (``--kv-cache-memory 1024 B holds fewer than 2 KV blocks ...``)
    when no cache dtype fits 2 blocks (--memory 1KiB was a ZeroDivisionError); a budget some
    dtypes fit prints the table, those that do not with 0 sequences and a note."""
    need, block = smallest_need()
    assert MIN_KV_BLOCKS == 2 and block == block_bytes("int8") and need == 2 * block
    assert_one_line_error(run_kv_size("--memory", "1KiB"),
                          f"--memory 1024 B holds fewer than 2 KV blocks of any cache dtype (the smallest: {block} B, "
                          f"16 tokens x 32 layers, fp8); give at least {need} B")
    result = run_kv_size("--memory", str(need - 1))
    assert result.exit_code == 1 and "holds fewer than 2 KV blocks" in result.output, result.output
    result = run_kv_size("--memory", str(need))
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines()[3:8]}
    assert rows["int8"][3] == "2" and rows["float32"][3] == "0" and rows["bf16/fp16"][3] == "1", result.output
    assert "float32, bf16/fp16, int4: fewer than 2 blocks" in result.output
    # a larger --block-size needs larger blocks: the bound scales with it
    result = run_kv_size("--memory", str(need), "--block-size", "32")
    assert result.exit_code == 1 and f"give at least {smallest_need(32)[0]} B" in result.output


def test_sequences_count_as_the_engines_startup_line():
    """``sequences`` = (blocks − 1) / blocks per sequence: block 0 is the null block, as the
    engine's startup line counts (was blocks / blocks per sequence)."""
    bf16 = block_bytes("bf16/fp16")  # 16 tokens: a 64-token context needs 4 blocks
    result = run_kv_size("--memory", str(9 * bf16), "--context", "64")
    row = next(line.split() for line in result.output.splitlines() if line.startswith("bf16/fp16"))
    assert row[3] == "9" and row[4] == "2.00", result.output


def test_context_beyond_the_model_is_capped_with_a_note():
    """As --max-model-len: capped at the model's context length (8,192), with one note on stderr."""
    capped = run_kv_size("--context", "100000")
    assert capped.exit_code == 0, capped.output
    assert capped.stderr.strip() == "llmd: --context 100000 is capped at the model's context length, 8192 tokens"
    assert "context 8192 tokens" in capped.stdout
    assert capped.stdout == run_kv_size("--context", "8192").stdout == run_kv_size().stdout
    within = run_kv_size("--context", "4096")
    assert within.exit_code == 0 and within.stderr == "" and "context 4096 tokens" in within.stdout


def test_byte_sizes_take_tebibytes():
    """`--memory 1TiB` / `2TB` (a server's KV budget) parse as the smaller units do; `kv-size` took
    no T prefix ("cannot parse byte size")."""
    from llmd.daemon.core.option_values import parse_bytes

    assert parse_bytes("1TiB") == 2**40 and parse_bytes("2TB") == 2 * 10**12 and parse_bytes("0.5 tib") == 2**39
    result = run_kv_size("--memory", "1TiB")
    assert result.exit_code == 0 and f"memory {2**40:,} B (1 TiB)" in result.output, result.output
    # an integer literal is exact; past 1 PiB is a typo, refused in one line (1e23 printed as
    # 99999999999999991611392 B and its blocks ran into the next column)
    assert parse_bytes("987654321012345") == 987654321012345
    huge = run_kv_size("--memory", "99999999999999999999999")
    assert huge.exit_code != 0 and "at most 1 PiB" in huge.output and "Traceback" not in huge.output, huge.output
    big = run_kv_size("--memory", "1000TiB").output.splitlines()
    row = next(line for line in big if line.startswith("bf16/fp16")).split()
    assert len(row) == 6 and row[3].isdigit(), big  # blocks and sequences stay apart
    # a size that is not whole MiB says so ("(4 MiB)" before; under 1 MiB it said "(0 MiB)")
    assert "memory 4,096,000 B (3.9 MiB)" in run_kv_size("--memory", "4000KiB").output
    from llmd.daemon.protocol import fmt_bytes

    assert (fmt_bytes(409600), fmt_bytes(2**29), fmt_bytes(3 * 2**29)) == ("400 KiB", "512 MiB", "1.5 GiB")


def test_the_table_is_titled_with_llmds_name_for_the_model():
    """The title names the model as ``--model`` and the daemon's id do (``random:llama-3-8b``), not
    the GGUF's own ``general.name`` ("Random Meta-Llama-3-8B", "Smollm2 135M 8k Lc100K Mix1 Ep2")."""
    result = run_kv_size("--memory", "1GiB", "--context", "1024")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith(f"{MODEL}: 32 layers, 8 KV heads x 128 dims;"), result.output
