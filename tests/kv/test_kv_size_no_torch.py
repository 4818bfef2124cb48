"""``llmd kv-size`` (and ``--total-memory``) without torch: a fresh process in which importing
torch, numpy, gguf, transformers or bitsandbytes raises prints the same table as before the KV formats became
torch-free (the figures below are today's, copied from its output for SmolLM2 and Gemma 3), and
imports no other command's module (the CLI loads commands lazily)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llmd.daemon.core.kv_size import KV_SIZE_ROWS, kv_cache_block_bytes, kv_cache_bytes_per_token, kv_size_rows
from llmd.daemon.kv import make_kv_cache_groups
from llmd.models.presets import preset_config
from llmd.models.weight_bytes import cpu_has_avx512_bf16, cpu_packs_bf16, cpu_runs_fused_decode
from llmd.quant.kv_format import ITEMSIZE, KV_CACHE_FORMATS

KV_SIZE_IN_A_BARE_PROCESS = textwrap.dedent("""
    import sys
    for name in ("torch", "numpy", "gguf", "transformers", "bitsandbytes"):
        sys.modules[name] = None  # any import of these now raises
    from llmd.daemon.cli.main import main
    for args in sys.argv[1:]:
        main(["kv-size", *args.split()], standalone_mode=False)
    other = ("llmd.daemon.cli.bench", "llmd.daemon.cli.chat", "llmd.daemon.cli.daemon", "llmd.tui", "aiohttp")
    print("IMPORTED:", *[m for m in other if m in sys.modules])  # the CLI imports a command's module on use
""")

# sequences = (blocks - 1) / blocks per sequence, as the engine's startup line counts (block 0: the null block)
SMOLLM2_TABLE = """\
1 KV cache group: full_attention (layers 0-29)
kv dtype         B/token      B/sequence    blocks   sequences  x 16-bit
float32           46,080     377,487,360       728        1.42     0.50x
bf16/fp16         23,040     188,743,680      1456        2.84     1.00x
fp8               12,240     100,270,080      2741        5.35     1.88x
int8              12,240     100,270,080      2741        5.35     1.88x
int4               8,098      64,880,640      4143        8.09     2.85x
"""
# keyed by cpu_packs_bf16(): the engine's 54 MiB packed copy of the tied head (every row but nf4's)
SMOLLM2_TOTAL_MEMORY = {False: """\
--weight-quant   weights MiB    KV MiB  sequences
none                     257      1791       9.95
""", True: """\
--weight-quant   weights MiB    KV MiB  sequences
none                     311      1737       9.65
"""}
# auto / gguf: + the fused batch-1 kernel's 92 MiB copy of the 4/8-bit blocks on an AVX512-VNNI CPU;
# keyed by (cpu_runs_fused_decode(), cpu_packs_bf16())
SMOLLM2_GGUF_ROWS = {(True, False): """\
auto                     439      1609       8.94
gguf                     236      1812      10.06
int8                     214      1834      10.18
""", (False, False): """\
auto                     347      1701       9.45
gguf                     144      1904      10.57
int8                     214      1834      10.18
""", (True, True): """\
auto                     493      1555       8.64
gguf                     290      1758       9.76
int8                     268      1780       9.88
""", (False, True): """\
auto                     401      1647       9.15
gguf                     198      1850      10.27
int8                     268      1780       9.88
"""}
# nf4: bitsandbytes' CPU layout keeps a bfloat16 absmax per 64 weights on an AVX512-BF16 CPU, float32 elsewhere
SMOLLM2_NF4 = {True: "nf4                      122      1926      10.70",
               False: "nf4                      126      1922      10.67"}
GEMMA3_ROWS = ("bf16/fp16         18,432     108,773,376     10922        4.93     1.00x",  # hybrid KV cache groups
               "bf16/fp16         18,432     603,979,776      1820        0.89     1.00x")  # every layer global


def kv_size_without_torch(tmp_path, *commands: str) -> str:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}  # a cold header cache (then the cached one)
    r = subprocess.run([sys.executable, "-c", KV_SIZE_IN_A_BARE_PROCESS, *commands], capture_output=True, text=True,
                       env=env, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("IMPORTED:"), r.stdout.splitlines()[-1]
    return r.stdout


def test_kv_size_imports_no_torch_and_prints_todays_numbers(tmp_path, smollm2_path):
    out = kv_size_without_torch(tmp_path, "", "--total-memory 2GiB", "--model random:qwen3-0.6b")
    assert SMOLLM2_TABLE in out
    packs = cpu_packs_bf16()
    rows = SMOLLM2_GGUF_ROWS[cpu_runs_fused_decode(), packs]
    assert SMOLLM2_TOTAL_MEMORY[packs] + rows in out
    assert rows.splitlines()[-1] + "\n" + SMOLLM2_NF4[cpu_has_avx512_bf16()] in out
    # random:qwen3-0.6b (int4: its 64-sequence residual out of the 512 MiB)
    assert "int4              44,266   1,614,807,040       758        0.30     2.60x" in out


def test_kv_size_gemma3_without_torch(tmp_path, gemma3_path):
    out = kv_size_without_torch(tmp_path, f"--model {gemma3_path} --context 32768")  # the assembled file's path
    assert all(row in out for row in GEMMA3_ROWS) and "(every layer global)" in out


def test_itemsizes_are_torchs():
    for name, size in ITEMSIZE.items():
        assert torch.empty(0, dtype=getattr(torch, name)).element_size() == size, name
    for fmt in KV_CACHE_FORMATS.values():
        if fmt.quantized:
            assert fmt.dtype == getattr(torch, fmt.dtype_name)
            assert fmt.scale_dtype == getattr(torch, fmt.scale_dtype_name)


@pytest.mark.parametrize("kv", list(KV_CACHE_FORMATS))
def test_dtype_names_and_torch_dtypes_give_the_same_bytes(kv):
    cfg = preset_config("random:qwen3-0.6b")
    groups = make_kv_cache_groups(cfg.layer_windows, True)
    for name in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, name)
        assert kv_cache_bytes_per_token(cfg, kv, name) == kv_cache_bytes_per_token(cfg, kv, dtype)
        assert kv_cache_block_bytes(cfg, groups, 16, kv, name) == kv_cache_block_bytes(cfg, groups, 16, kv, dtype)
    rows = {r.name: r for r in kv_size_rows(cfg, 4096, 2**30, 16)}
    for row_name, kv_dtype, model_dtype in KV_SIZE_ROWS:
        per_token = kv_cache_bytes_per_token(cfg, kv_dtype, getattr(torch, model_dtype))
        if kv_dtype == "int4":  # plus its residual, amortized over the pool
            assert per_token < rows[row_name].bytes_per_token < 1.1 * per_token
        else:
            assert rows[row_name].bytes_per_token == per_token
