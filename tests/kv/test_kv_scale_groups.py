"""Grouped KV scales (``--kv-scale-group-size``, issue 19): int8/fp8 with one dynamic scale per 32
or 64 channels of a (token, KV head): the format, its refusals, the stored bytes, what the
reference reads back, the prefix-cache scheme and SmolLM2 end to end on both CPU backends."""

from __future__ import annotations

import pytest
import torch

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.request import SamplingParams
from llmd.daemon.kv.prefix_cache import extra_keys
from llmd.kernels import reference
from llmd.quant.kv import PagedKVCache, compute_scales, dequantize, get_format


def test_format_scheme_bytes_and_refusals():
    g32 = get_format("int8", 32)
    assert (g32.group_size, g32.scheme, get_format("int8").scheme) == (32, "int8-g32", "int8")
    assert get_format("fp8_e5m2", 64).scheme == "fp8_e5m2-g64" and get_format(g32) is g32
    # bytes per (token, KV head) of K and V, halved: codes + a float32 scale per group
    assert g32.head_bytes(64, "float32") == 64 + 2 * 4 and get_format("int8").head_bytes(64, "float32") == 68
    assert get_format("int8", 64).head_bytes(256, "bfloat16") == 256 + 4 * 4
    for name, size, msg in (("auto", 32, "8-bit"), ("int4", 32, "8-bit"), ("int8", 12, "power of two"),
                            ("int8", 4, "power of two")):
        with pytest.raises(ValueError, match=msg):
            get_format(name, size)
    with pytest.raises(ValueError, match="--kv-scale-group-size 64 needs head_dim a multiple of 64"):
        get_format("int8", 64).check_head_dim(96)


def test_config_refusals(monkeypatch):
    def resolve(**kw):
        return EngineConfig(device="cpu", **kw).resolve()

    assert resolve(kv_cache_dtype="int8", kv_scale_group_size=32).kv_format.group_size == 32
    assert resolve(kv_cache_dtype="int8").kv_format is get_format("int8")
    with pytest.raises(LlmdError, match="needs an 8-bit --kv-cache-dtype"):
        resolve(kv_scale_group_size=32)
    with pytest.raises(LlmdError, match="dynamic scales"):
        resolve(kv_cache_dtype="int8", kv_scale_group_size=32, kv_scales=(0.1, 0.1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(LlmdError, match="--attention-backend cpu or torch"):
        resolve(kv_cache_dtype="fp8_e4m3", kv_scale_group_size=64, attention_backend="triton")


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_reference_reads_codes_times_their_group_scale_and_groups_cut_the_error(name):
    """Stored codes read back as ``code × scale`` of their own 32-channel group (float64,
    exactly); on keys with one outlier channel per head (Gemma 3's K after RoPE has amax/rms
    6-11) per-group int8 scales quantize the other groups on a finer grid, so the error halves."""
    g = torch.Generator().manual_seed(3)
    t, heads, d = 40, 2, 128
    k = torch.randn(t, heads, d, generator=g)
    k[:, :, 5] *= 30  # an outlier channel in the first group
    caches = [PagedKVCache.allocate((2, 4, 16, heads, d), get_format(name, s), torch.float32, "cpu") for s in (0, 32)]
    slots = torch.arange(t) + 3
    errs = []
    for cache in caches:
        reference.store_kv(k, k, cache, slots)
        got_k, _ = reference.gather_kv(cache, torch.tensor([0, 1, 2, 3]), t + 3, torch.float64)
        errs.append((got_k[3:] - k.double()).norm().item())
    grouped = caches[1]
    assert grouped.scales.shape == (2, 4, 16, heads, 4)
    s = grouped.scales[0].view(-1, heads, 4)[slots]
    assert torch.equal(s, compute_scales(k, grouped.fmt))  # amax of each 32-channel group / qmax
    codes = grouped.data[0].view(-1, heads, d)[slots]
    want = (codes.double().unflatten(-1, (4, 32)) * s.double()[..., None]).flatten(-2)
    assert torch.equal(dequantize(codes, s, torch.float64), want)
    # int8: measured 0.50 (the outlier's own group keeps its coarse grid); fp8's grid is already
    # relative, so groups only move small values off the subnormals (e4m3 measured 0.94)
    assert errs[1] < (0.6 if name == "int8" else 1.0) * errs[0], errs


def test_prefix_cache_scheme_startup_line_and_smollm2_on_both_backends(make_engine):
    """Blocks written with grouped scales never serve a per-token-scale engine (the scheme is in
    the block hash's extra keys); the startup line names the groups; SmolLM2 greedy tokens with
    int8 / 32-channel scales agree between the fast cpu backend and the torch reference."""
    kw = {"kv_cache_dtype": "int8", "kv_cache_memory": 8 * 2**20, "max_num_seqs": 4}
    engines = [make_engine(**kw, kv_scale_group_size=s, attention_backend=b)
               for s, b in ((0, "cpu"), (32, "cpu"), (64, "cpu"), (32, "torch"))]
    keys = [extra_keys(e.kv_manager.model_id, e.kv_manager.kv_cache_dtype, None) for e in engines]
    assert len(set(keys[:3])) == 3 and keys[1] == keys[3]
    assert engines[1].kv_manager.kv_cache_dtype.startswith("int8-g32|")
    assert "dynamic float32 scales per 32 channels" in engines[1].runtime_summary() + engines[1].capacity_summary()
    assert engines[1].bytes_per_token == 30 * 2 * 3 * (64 + 2 * 4)  # SmolLM2: 30 layers, 3 KV heads, head_dim 64
    prompt = "The three primary colors are"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = [e.generate([prompt], params)[0]["token_ids"] for e in (engines[1], engines[3])]
    assert len(outs[0]) == 12 and outs[0] == outs[1]


def test_cli_refusals_are_one_line_before_any_weights_load():
    from click.testing import CliRunner

    from llmd.daemon.cli.main import main

    for args, text in ((["generate", "hi", "--kv-scale-group-size", "32"], "needs an 8-bit --kv-cache-dtype"),
                       (["bench", "kv-quality", "--scale-groups", "0,x"], "--scale-groups must be a comma list"),
                       (["bench", "kv-quality", "--scale-groups", "0,48"], "power of two >= 8, got 48")):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, result.output
        last = result.output.strip().splitlines()[-1]
        assert last.startswith("llmd: error: ") and text in last and "Traceback" not in result.output

