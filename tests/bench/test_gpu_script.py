"""``benchmarks/gpu_kernels.sh`` cannot rot on a machine without a GPU: its bash parses, every
``python -m`` step names a module that exists, its time limits fit one 15-minute device lease,
its kernel check and bench cover every KV format,
and its end-to-end entry point (``llmd.daemon.bench.e2e``) runs on a 2-layer random Qwen3-0.6B
with a handful of requests."""

import importlib.util
import re
import subprocess
from pathlib import Path

from llmd.daemon.bench.e2e import main

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.sh"
LEASE_S, KILL_GRACE_S = 12 * 60, 5


def test_script_parses_and_fits_the_lease():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    steps = re.findall(r"^\s*step (\S+) (\d+) (.*)$", text, flags=re.M)
    names = [n for n, _, _ in steps]
    assert {"env", "install", "check", "e2e", "pytest", "engine-qwen3", "bench"} <= set(names)
    assert sum(int(limit) + KILL_GRACE_S for _, limit, _ in steps) <= LEASE_S
    assert f"timeout -k {KILL_GRACE_S} " in text and "set -e" not in text.replace("no `set -e`", "")
    modules = set(re.findall(r"python -m ([\w.]+)", text))
    assert "llmd.daemon.bench.e2e" in modules and "click" not in text
    for m in modules:
        assert importlib.util.find_spec(m) is not None, m
    e2e = next(cmd for n, _, cmd in steps if n == "e2e")
    assert "--model random:qwen3-0.6b --requests 256 --min-len 100 --max-len 1024" in e2e
    assert "--max-num-seqs 256" in text


def test_check_and_bench_cover_every_kv_format():
    """The script's check has a decode, split and prefill row for every KV dtype the Triton kernels
    read (int4 included: its own kernels; not the CPU-only 16-bit float caches), and its bench times
    every one of them."""
    import inspect

    from llmd.kernels.bench import CHECK_DIMS, check_cases, run_kernel_bench
    from llmd.quant.kv_format import CPU_ONLY_FORMATS, KV_CACHE_FORMATS

    triton_formats = set(KV_CACHE_FORMATS) - set(CPU_ONLY_FORMATS)
    assert set(CHECK_DIMS["kv"]) == triton_formats
    rows = {(c["kv"], c["path"]) for c in check_cases()}
    assert rows == {(kv, p) for kv in CHECK_DIMS["kv"] for p in CHECK_DIMS["path"]}
    assert set(inspect.signature(run_kernel_bench).parameters["kv_dtypes"].default) == triton_formats


def test_e2e_entry_runs_tiny_and_checks_its_target(capsys):
    """3 requests on 2 layers (CPU, float32); an unreachable --target-tok-s makes it exit 1."""
    rc = main(["--model", "random:qwen3-0.6b:layers=2", "--device", "cpu", "--dtype", "float32", "--requests", "3",
               "--min-len", "4", "--max-len", "6", "--max-num-seqs", "4", "--max-model-len", "64",
               "--kv-cache-memory", str(4 * 2**20), "--target-tok-s", "1e9"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL: " in out and "< target" in out and "workload draws" not in out
    tokens = int(re.search(r"output: (\d+) tokens", out).group(1))
    assert 3 * 4 <= tokens <= 3 * 6
    assert re.search(r"host time per decode step p50 [\d.]+ ms", out)
