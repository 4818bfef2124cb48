"""EngineConfig defaults: ``--dtype auto`` (native bf16 probes), ``--threads``, the CPU attention
backend; the CLI's one-line errors for them (no model is loaded)."""

from __future__ import annotations

import os

import pytest
import torch
from click.testing import CliRunner

from llmd.daemon.cli.main import main
from llmd.daemon.core.config import EngineConfig, cpu_has_native_bf16, default_threads
from llmd.daemon.core.errors import LlmdError


def probes(monkeypatch, avx512_bf16: bool, amx: bool, mkldnn_bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    # true on any AVX512BW CPU (bf16 emulated there): must not count
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: mkldnn_bf16, raising=False)


@pytest.mark.parametrize("avx512_bf16,amx,expected", [(True, False, "bfloat16"), (False, True, "bfloat16"),
                                                      (True, True, "bfloat16"), (False, False, "float32")])
def test_dtype_auto_on_cpu_follows_the_native_bf16_probes(monkeypatch, avx512_bf16, amx, expected):
    probes(monkeypatch, avx512_bf16, amx)
    assert cpu_has_native_bf16() is (expected == "bfloat16")
    for given in (None, "auto"):
        c = EngineConfig(device="cpu", dtype=given).resolve()
        assert c.dtype == expected and c.torch_dtype == getattr(torch, expected) and c.dtype_auto
    assert EngineConfig(device="cpu", dtype="float32").resolve().dtype == "float32"  # explicit wins
    assert not getattr(EngineConfig(device="cpu", dtype="float32").resolve(), "dtype_auto", False)


def test_a_failing_probe_counts_as_no_bf16(monkeypatch):
    def boom():
        raise RuntimeError("no cpuinfo")

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", boom)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert EngineConfig(device="cpu").resolve().dtype == "float32"


def test_cuda_defaults_bfloat16_and_triton(monkeypatch):
    probes(monkeypatch, False, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    c = EngineConfig(device="cuda").resolve()
    assert (c.dtype, c.attention_backend) == ("bfloat16", "triton")


def test_attention_backend_default_and_choices(monkeypatch):
    probes(monkeypatch, True, False)
    assert EngineConfig(device="cpu").resolve().attention_backend == "cpu"
    assert EngineConfig(device="cpu", dtype="float64").resolve().attention_backend == "torch"  # the oracle
    for name in ("cpu", "torch"):
        assert EngineConfig(device="cpu", attention_backend=name).resolve().attention_backend == name
    with pytest.raises(LlmdError, match="must be one of cpu, torch, triton"):
        EngineConfig(device="cpu", attention_backend="flash").resolve()
    with pytest.raises(LlmdError, match="float64"):
        EngineConfig(device="cpu", dtype="float64", attention_backend="cpu").resolve()
    with pytest.raises(LlmdError, match="--dtype must be one of auto, float32"):
        EngineConfig(device="cpu", dtype="fp4").resolve()


def test_threads_default_and_validation(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})
    assert default_threads() == 3 and EngineConfig(device="cpu").resolve().threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # an explicit OpenMP setting is respected
    assert EngineConfig(device="cpu").resolve().threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert default_threads() == 3
    assert EngineConfig(device="cpu", threads=4).resolve().threads == 4
    for bad in (0, -2, True, 1.5):
        with pytest.raises(LlmdError, match=r"^--threads must be an integer >= 1, got "):
            EngineConfig(device="cpu", threads=bad).resolve()


def test_apply_threads_sets_torch_once():
    before = torch.get_num_threads()
    try:
        c = EngineConfig(device="cpu", threads=1).resolve()
        c.apply_threads()
        assert torch.get_num_threads() == 1
        c.apply_threads()  # idempotent
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cli_threads_and_dtype_options():
    runner = CliRunner()
    res = runner.invoke(main, ["generate", "hi", "--threads", "0"])
    assert res.exit_code == 1
    assert res.output.strip().splitlines()[-1] == "llmd: error: --threads must be an integer >= 1, got 0"
    assert "Traceback" not in res.output and "loading" not in res.output  # before the weights load
    res = runner.invoke(main, ["generate", "hi", "--dtype", "fp4"])
    assert res.exit_code == 2 and "'fp4' is not one of 'auto'" in res.output
    res = runner.invoke(main, ["generate", "hi", "--attention-backend", "flash"])
    assert res.exit_code == 2 and "'cpu'" in res.output
    commands = (["generate"], ["serve"], ["chat"], ["bench", "throughput"], ["bench", "kv-quality"],
                ["bench", "prefix"])
    for cmd in commands:
        text = runner.invoke(main, [*cmd, "--help"]).output
        assert "--threads" in text and "--dtype" in text and "auto" in text, cmd


def test_triton_backend_refuses_an_unsupported_head_dim_at_engine_configuration(tmp_path, monkeypatch):
    """head_dim 20 (not a power of two in 16..256): one LlmdError line when the engine is built,
    before any kernel launch, instead of a Triton compile error on the first request."""
    import gguf
    from tiny_engine import ByteTokenizer
    from tiny_gguf import write_tiny_llama

    from llmd.daemon.core.engine import Engine
    from llmd.models.gguf_loader import load_model

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the config accept triton on a CPU
    path = tmp_path / "hd20.gguf"
    write_tiny_llama(path, hidden=60, heads=3, kv_heads=1, qtype=gguf.GGMLQuantizationType.F32)
    model, _ = load_model(str(path), torch.float32)
    with pytest.raises(LlmdError, match="head_dim a power of two") as e:
        Engine(model, ByteTokenizer(), EngineConfig(device="cpu", dtype="float32", attention_backend="triton",
                                                    kv_cache_memory=2**20, threads=1))
    assert "\n" not in str(e.value)
    Engine(model, ByteTokenizer(), EngineConfig(device="cpu", dtype="float32", kv_cache_memory=2**20, threads=1))


def test_a_kv_cache_memory_below_two_blocks_names_the_block_size(tmp_path):
    """--kv-cache-memory too small for 2 blocks: one line with the block's bytes and the least
    memory that works (int4's residual wording only when there is a residual)."""
    from tiny_engine import tiny_engine

    with pytest.raises(LlmdError) as e:
        tiny_engine(tmp_path / "t.gguf", kv_cache_memory=1024)
    msg = str(e.value)
    assert "holds fewer than 2 KV blocks of" in msg and "int4" not in msg, msg
    with pytest.raises(LlmdError, match="beside int4's open-block residual"):
        tiny_engine(tmp_path / "u.gguf", kv_cache_memory=1024, kv_cache_dtype="int4", attention_backend="cpu")
