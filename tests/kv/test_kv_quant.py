"""KV formats (llmd.quant.kv), the torch reference with quantized caches, sizes and engine flags."""

import pytest
import torch

from llmd.daemon.core.config import EngineConfig, parse_kv_scales
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.kv_size import kv_cache_bytes_per_token, kv_size_rows
from llmd.kernels import reference
from llmd.quant.kv import (
    KV_CACHE_FORMATS,
    PagedKVCache,
    compute_scales,
    dequantize,
    get_format,
    quantize,
    quantize_dequantize,
    round_half_even,
)

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
#: relative error of quantize→dequantize on Gaussian rows (per-(token, head) amax scales)
REL_ERR = {"int8": 0.01, "fp8_e4m3": 0.04, "fp8_e5m2": 0.08}


def test_round_half_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 0.50000006, -0.0, 3.2, 126.5, -127.5])
    assert round_half_even(x).tolist() == [0, 2, 2, -0, -2, -2, 0, 1, 0, 3, 126, -128]


def fp8_ties(fmt) -> torch.Tensor:
    """Every finite code of ``fmt`` and every midpoint between neighbours (the ties), ± both."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    codes = codes[codes.isfinite()].unique()
    mids = (codes[:-1] + codes[1:]) / 2
    return torch.cat([codes, mids])


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_codes_equal_torch_cast_bit_for_bit(name):
    """The explicit grid rounding is torch's own float32 -> float8 cast (ties to even), on ties,
    subnormals, binade edges and random magnitudes."""
    fmt = get_format(name)
    g = torch.Generator().manual_seed(1)
    rnd = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-24, 17, (200_000,), generator=g).float())
    y = torch.cat([fp8_ties(fmt), rnd.clamp(-fmt.qmax, fmt.qmax)]).reshape(-1, 1, 1)
    q = quantize(y, torch.ones(y.shape[0], 1), fmt)
    assert torch.equal(q.view(torch.uint8), y.to(fmt.dtype).view(torch.uint8))


@pytest.mark.parametrize("name", FORMATS)
def test_quantize_roundtrip_and_grid(name):
    fmt = get_format(name)
    x = torch.randn(200, 3, 64, generator=torch.Generator().manual_seed(0)) * 5
    s = compute_scales(x, fmt)
    q = quantize(x, s, fmt)
    assert q.dtype == fmt.dtype and s.shape == (200, 3) and s.dtype == torch.float32
    back = dequantize(q, s)
    assert ((back - x).norm() / x.norm()).item() < REL_ERR[name]
    # the explicit grid rounding equals torch's cast / torch.round (ties to even) bit for bit
    y = torch.clamp(x / s[..., None], -fmt.qmax, fmt.qmax)
    cast = y.to(fmt.dtype) if fmt.is_fp8 else torch.round(y).to(torch.int8)
    assert torch.equal(q.view(torch.uint8), cast.view(torch.uint8))
    assert q.float().abs().max().item() == fmt.qmax  # amax maps to qmax exactly


@pytest.mark.parametrize("name", FORMATS)
def test_zero_rows_and_out_of_range_values_stay_finite(name):
    fmt = get_format(name)
    zeros = torch.zeros(2, 2, 64)
    s = compute_scales(zeros, fmt)
    assert torch.all(s > 0) and torch.equal(dequantize(quantize(zeros, s, fmt), s), zeros)
    huge = torch.tensor([[[1e6, -1e6, 1e38, 3.0]]])
    back = dequantize(quantize(huge, torch.ones(1, 1), fmt), torch.ones(1, 1))  # static scale 1.0: clamps
    assert torch.isfinite(back).all() and back.abs().max().item() == fmt.qmax


def test_kv_bytes_per_token_smollm2(smollm2):
    """Issue 4 memory bullet: SmolLM2 int8 + float32 scales 12,240 B/token vs 23,040 in 16-bit (1.88×)."""
    cfg = smollm2[1]
    assert kv_cache_bytes_per_token(cfg, "int8", torch.float32) == 12_240
    assert kv_cache_bytes_per_token(cfg, "fp8_e4m3", torch.bfloat16) == 12_240
    assert kv_cache_bytes_per_token(cfg, "auto", torch.bfloat16) == 23_040
    assert kv_cache_bytes_per_token(cfg, "auto", torch.float32) == 46_080
    rows = {r.name: r for r in kv_size_rows(cfg, 8192, 512 * 2**20, 16)}
    assert rows["int8"].bytes_per_token == 12_240 and rows["bf16/fp16"].bytes_per_token == 23_040
    assert round(rows["int8"].num_blocks / rows["bf16/fp16"].num_blocks, 2) == 1.88


def test_engine_block_count_follows_bytes_per_token(make_engine):
    mem = 64 * 2**20
    e8 = make_engine(kv_cache_dtype="int8", kv_cache_memory=mem)
    assert e8.bytes_per_token == 12_240 and e8.num_blocks == mem // (16 * 12_240)
    assert e8.runner.kv_caches[0].dtype == torch.int8
    assert e8.runner.kv_scales[0].shape == (2, e8.num_blocks, 16, 3) and e8.runner.kv_scales[0].dtype == torch.float32
    assert "int8" in e8.capacity_summary() and "12240 B/token" in e8.capacity_summary()
    e32 = make_engine(kv_cache_memory=mem)
    assert e32.runner.kv_scales[0] is None and e32.bytes_per_token == 46_080


def test_config_validation():
    with pytest.raises(LlmdError, match="kv-cache-dtype"):
        EngineConfig(device="cpu", kv_cache_dtype="int2").resolve()
    with pytest.raises(LlmdError, match="kv-scales"):
        EngineConfig(device="cpu", kv_scales=(1.0, 1.0)).resolve()
    with pytest.raises(LlmdError, match="kv-scales"):
        EngineConfig(device="cpu", kv_cache_dtype="int8", kv_scales=(0.0, 1.0)).resolve()
    with pytest.raises(LlmdError, match="attention-backend"):
        EngineConfig(device="cpu", attention_backend="flash").resolve()
    assert EngineConfig(device="cpu").resolve().attention_backend == "cpu"  # the fast CPU path
    assert EngineConfig(device="cpu", attention_backend="torch").resolve().attention_backend == "torch"  # the oracle
    assert parse_kv_scales("0.5,2") == (0.5, 2.0)
    with pytest.raises(LlmdError):
        parse_kv_scales("0.5")


def test_float64_is_a_cpu_torch_backend_dtype(monkeypatch):
    """``--dtype float64`` (reference runs) needs the torch backend, whose attention then
    computes in float64: equal to the float64 oracle, not to float32 compute."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(LlmdError, match="float64"):
        EngineConfig(device="cpu", dtype="float64", attention_backend="triton").resolve()
    assert EngineConfig(device="cpu", dtype="float64").resolve().torch_dtype == torch.float64
    from llmd.kernels import AttentionMetadata, ops

    g = torch.Generator().manual_seed(0)
    n, bs = 37, 16
    k, v = (torch.randn(n, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(5, 6, 64, generator=g, dtype=torch.float64)
    cache = torch.zeros(2, 4, bs, 2, 64, dtype=torch.float64)
    table = torch.tensor([[3, 1, 2]], dtype=torch.int32)
    slots = (table[0, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs)
    reference.store_kv(k, v, cache, slots)
    meta = AttentionMetadata(slots[-5:], table, torch.tensor([0, 5], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), [5], [n], bs, "torch")
    out = ops.paged_attention(q, cache, meta, 0.125)
    assert out.dtype == torch.float64
    assert torch.equal(out, reference.attention_one_seq(q, k, v, 0.125, compute_dtype=torch.float64))
    assert not torch.equal(out, reference.attention_one_seq(q, k, v, 0.125, compute_dtype=torch.float32))


@pytest.mark.parametrize("name", FORMATS)
def test_reference_store_then_read(name):
    """The torch path writes codes + scales at the slot and reads back code × scale."""
    fmt = get_format(name)
    cache = PagedKVCache.allocate((2, 4, 16, 2, 64), fmt, torch.float32, "cpu")
    k, v = torch.randn(5, 2, 64) * 0.02, torch.randn(5, 2, 64) * 7.5
    slots = torch.tensor([16, 17, 40, -1, 63])
    reference.store_kv(k, v, cache, slots)
    kb, vb = reference.gather_kv(cache, torch.tensor([1, 2, 3], dtype=torch.int32), 48)
    for i, s in enumerate([16, 17, 40]):
        assert torch.equal(kb[s - 16], quantize_dequantize(k[i : i + 1], fmt)[0])
        assert torch.equal(vb[s - 16], quantize_dequantize(v[i : i + 1], fmt)[0])
    assert cache.scales[0, 2, 0].abs().sum() == 0  # the padded (-1) slot wrote nothing


def test_static_scales_fill_the_scale_slots():
    cache = PagedKVCache.allocate((2, 2, 16, 1, 64), KV_CACHE_FORMATS["fp8_e4m3"], torch.float32, "cpu", (0.5, 2.0))
    reference.store_kv(torch.full((1, 1, 64), 1000.0), torch.ones(1, 1, 64), cache, torch.tensor([16]))
    assert cache.scales[:, 1, 0, 0].tolist() == [0.5, 2.0]
    k, v = reference.gather_kv(cache, torch.tensor([1], dtype=torch.int32), 1)
    assert k.max().item() == 448 * 0.5 and v.max().item() == 1.0  # clamped, finite


def test_cli_flags_and_bench_kernels_without_cuda():
    from click.testing import CliRunner

    from llmd.daemon.cli.main import main

    runner = CliRunner()
    help_text = runner.invoke(main, ["generate", "--help"]).output
    for flag in ("--kv-cache-dtype", "--kv-scales", "--attention-backend", "fp8_e4m3"):
        assert flag in help_text
    assert "kv-quality" in runner.invoke(main, ["bench", "--help"]).output
    if not torch.cuda.is_available():
        res = runner.invoke(main, ["bench", "kernels"])
        assert res.exit_code == 1 and "needs a CUDA device" in res.output
