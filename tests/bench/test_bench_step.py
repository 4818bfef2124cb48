"""``llmd bench step`` on a tiny random GGUF (batch 2, context 32, one repetition): the table has
a row per (backend, batch, context), every component time is positive, and the parts do not
exceed the whole step grossly."""

import pytest
import torch
from click.testing import CliRunner
from tiny_gguf import write_tiny_llama

from llmd.daemon.cli.main import main

COLS = ["prep", "linears", "lm_head", "attn", "rest", "sample", "step", "KV_MB", "KV_flr", "attn/KV", "step/flr",
        "KV_gth", "attn/gth"]


def test_bench_step_tiny(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(main, ["bench", "step", "--model", str(path), "--batch", "2", "--context", "32",
                                        "--reps", "1", "--dtype", "float32", "--attention-backend", "torch,cpu",
                                        "--bandwidth-mib", "16"], env={"OMP_NUM_THREADS": "1"})
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("llmd bench step: tiny.gguf on cpu, 1 threads")
    head = next(i for i, ln in enumerate(lines) if ln.startswith("dtype"))
    assert lines[head].split()[4:17] == COLS
    rows = {tuple(ln.split()[:4]): ln.split() for ln in lines[head + 1 : head + 3]}
    assert set(rows) == {("float32", "torch", "2", "32"), ("float32", "cpu", "2", "32")}
    for key, f in rows.items():
        t = dict(zip(COLS, map(float, f[4:17])))
        assert all(t[c] > 0 for c in ("prep", "linears", "lm_head", "attn", "sample", "step", "KV_MB", "KV_flr",
                                      "KV_gth", "attn/gth")), key
        # batch x tokens x layers x K,V x heads x dim x bytes
        assert abs(t["KV_MB"] - 2 * 33 * 2 * 2 * 2 * 16 * 4 / 1e6) < 1e-4
        parts = t["prep"] + t["linears"] + t["lm_head"] + t["attn"] + t["sample"]
        assert parts <= 2 * t["step"] + 20, (key, t)  # ms; the slack absorbs a preempted single repetition
    assert rows[("float32", "cpu", "2", "32")][17] != "-"  # fast / reference ratio printed
    assert lines[head].split()[-1] == "GB/s"  # each row's own bandwidth, its KV_flr's divisor
    for f in rows.values():
        gbs = float(f[-1])
        assert gbs > 0 and abs(float(f[12]) - float(f[11]) / gbs) <= 0.02 * float(f[12]) + 0.01  # KV_flr = MB / (GB/s)
    assert lines[head + 3].startswith("targets (issue 13) at batch 32, context 512")
    assert "no row at batch 32, context 512" in lines[head + 4]


def test_each_attention_repetition_pairs_with_the_bandwidth_read_just_before_it():
    """paired_attention: a probe read (after setup) precedes every timed attention, the warm-up
    pair is dropped, and the table's attn/KV is the median of the per-pair ratios, not the ratio
    of the medians."""
    import dataclasses

    from llmd.daemon.bench.step import StepTimes, paired_attention
    from llmd.daemon.bench.step_report import attn_ratio, format_table

    calls = []

    class Probe:
        n = 0

        def read(self):
            self.n += 1
            calls.append(("probe", self.n))
            return float(self.n)

    t, bw, pairs = paired_attention(lambda arg: calls.append(("attn", arg)), lambda: len(calls), 3, Probe(),
                                    torch.device("cpu"))
    kinds = [c[0] for c in calls]
    assert kinds == ["probe", "attn"] * 4 and [p[1] for p in pairs] == [2.0, 3.0, 4.0] and bw == 3.0
    assert all(c[1] == i - 1 for i, c in enumerate(calls) if c[0] == "attn")  # setup ran before the probe
    calls.clear()
    paired_attention(lambda arg: calls.append("attn"), lambda: None, 2, Probe(), torch.device("cpu"),
                     gather=lambda: calls.append("gather"))
    assert [c if isinstance(c, str) else c[0] for c in calls] == ["probe", "gather", "attn"] * 3  # gather just before
    row = StepTimes("float32", "cpu", 32, 512, prep=0, linears=0.02, lm_head=0.005, attention=0.03, forward=0.05,
                    sample=0, step=0.06, kv_bytes=10**8, kv_floor=0.02, cpu_other=0, bandwidth=5e9, attn_ratio=1.25)
    assert attn_ratio(row) == 1.25 and attn_ratio(dataclasses.replace(row, attn_ratio=float("nan"))) == 1.5
    assert "attention 1.25x (met)" in "\n".join(format_table([row]))


def test_bench_step_bfloat16_times_the_forwards_own_store(tmp_path, monkeypatch):
    """On a bfloat16 cpu engine the forward stores K/V inside its RoPE pass
    (models/glue_forward.py), so the attention component times the forward's own attention block
    (``glue_forward.attention``), not ``store_kv`` + ``paged_attention``."""
    from llmd.daemon.bench import step as step_mod
    from llmd.daemon.bench.step import run_step_bench
    from llmd.kernels.native import build
    from llmd.models import glue_forward

    if build.load_glue() is None:
        pytest.skip("no C compiler for the native glue")
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
    calls = {"attention": 0, "store_kv": 0}
    real_attention, real_store = glue_forward.attention, step_mod.kernels.store_kv

    def counted(*a, **k):
        calls["attention"] += 1
        return real_attention(*a, **k)

    def store(*a, **k):
        calls["store_kv"] += 1
        return real_store(*a, **k)

    monkeypatch.setattr(glue_forward, "attention", counted)
    monkeypatch.setattr(step_mod.kernels, "store_kv", store)
    rows = run_step_bench(dict(model=str(path), device="cpu", threads=1), ["bfloat16"], ["cpu"], [2], [32], reps=1,
                          bandwidth_mib=16, echo=lambda s: None)
    assert len(rows) == 1 and rows[0].attention > 0
    # the bench's attention: 2 layers x (warm-up + 1 repetition); the forwards it also times add theirs
    assert calls["attention"] >= 2 * 2 and calls["store_kv"] == 0


def test_the_step_ratio_pairs_the_step_with_its_own_floor(monkeypatch):
    """paired_step: per repetition a bandwidth read, then the linears, the LM head and the step,
    back to back; the warm-up is dropped and the ratio is the median of the per-repetition
    ratios, so one repetition in a slower phase (every component 3x) moves nothing; the table
    prints it."""
    import dataclasses

    import llmd.daemon.bench.step_pairs as sp
    from llmd.daemon.bench.step import StepTimes, paired_step
    from llmd.daemon.bench.step_report import format_table, step_ratio

    calls, clock, phases = [], [0.0], iter([1, 1, 3, 1])  # the warm-up, then three repetitions
    phase = [1]

    class Probe:
        def read(self):
            calls.append("probe")
            phase[0] = next(phases)
            return 1e9  # bytes/s: 10 MB of KV read in 0.01 s

    def op(name, seconds):
        def run():
            calls.append(name)
            clock[0] += seconds * phase[0]
        return run

    monkeypatch.setattr(sp.time, "perf_counter", lambda: clock[0])
    ratio, rows = paired_step(op("step", 0.05), op("linears", 0.02), op("lm_head", 0.005), Probe(), 10**7, 3,
                              torch.device("cpu"))
    assert calls == ["probe", "linears", "lm_head", "step"] * 4 and len(rows) == 3
    assert [round(st / (lin + head + 10**7 / bw), 4) for st, lin, head, bw in rows] == [1.4286, 1.7647, 1.4286]
    assert abs(ratio - 0.05 / 0.035) < 1e-9
    row = StepTimes("bfloat16", "cpu", 32, 512, prep=0, linears=0.02, lm_head=0.005, attention=0.03, forward=0.05,
                    sample=0, step=0.06, kv_bytes=10**8, kv_floor=0.02, cpu_other=0, bandwidth=5e9, step_ratio=1.25)
    assert step_ratio(row) == 1.25
    assert abs(step_ratio(dataclasses.replace(row, step_ratio=float("nan"))) - 0.06 / 0.045) < 1e-12
    assert "step 1.25x (met)" in "\n".join(format_table([row]))


def test_bench_step_refuses_int4_in_one_line(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
    res = CliRunner().invoke(main, ["bench", "step", "--model", str(path), "--batch", "2", "--context", "32",
                                    "--reps", "1", "--kv-cache-dtype", "int4"])
    assert res.exit_code != 0
    assert res.output.strip().splitlines()[-1].startswith("llmd: error: llmd bench step does not take "
                                                          "--kv-cache-dtype int4")
