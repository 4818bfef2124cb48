"""The GPU script's engine step (``llmd.daemon.bench.backends``) on CPU: a 1-layer random
Qwen3-0.6B (real layer shape and vocabulary) in bfloat16, cpu vs torch attention backends over
the same weights."""

import pytest

from llmd.daemon.bench.backends import main

ARGS = ["--model", "random:qwen3-0.6b:layers=1", "--backends", "cpu,torch", "--device", "cpu", "--prompts", "1",
        "--prompt-len", "40", "--requests", "2", "--output-len", "3", "--kv-cache-memory", str(8 * 2**20)]


@pytest.mark.parametrize("tolerance, rc", [("0.05", 0), ("1e-9", 1)])
def test_backends_agree_within_tolerance(capsys, tolerance, rc):
    """Default tolerance: both rows ok; 1e-9: the torch row (bf16 rounding differs) fails the step."""
    assert main([*ARGS, "--tolerance", tolerance]) == rc
    out = capsys.readouterr().out.splitlines()
    cpu, torch_row = (next(line for line in out if line.startswith(b + " ")) for b in ("cpu", "torch"))
    assert "0.00e+00" in cpu and cpu.endswith(" ok")
    assert torch_row.endswith(" ok" if rc == 0 else " FAIL"), torch_row
