"""``--kv-cache-dtype float16 / bfloat16`` (K/V rounded to a 16-bit float, no scales) and the
default that picks float16 for a GGUF model ``--dtype auto`` put in float32 on a CPU without
native bfloat16 (llama.cpp's default ``f16`` cache: half the KV bytes a decode reads).

Measured on SmolLM2 over the whole kv-quality text (962 tokens, teacher-forced in chunks of 64,
float32 model, torch and cpu backends alike, 2026-12-06): float16 ΔNLL -0.0001 %, top-1 100 %;
bfloat16 ΔNLL -0.012 %, top-1 99.17 %. The tests below check the first 320 tokens (CI seconds;
there float16 -0.0073 % / 100 %, bfloat16 -0.017 % / 99.37 % on the Zen 3)."""

from __future__ import annotations

import pytest
import torch

import llmd.daemon.core.config as config_mod
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.errors import LlmdError


def test_float32_by_auto_gguf_model_defaults_to_a_float16_cache(monkeypatch):
    monkeypatch.setattr(config_mod, "cpu_has_native_bf16", lambda: False)
    monkeypatch.delenv("LLMD_FP16_KV", raising=False)
    auto = EngineConfig(device="cpu").resolve()
    assert (auto.dtype, auto.kv_cache_dtype) == ("float32", "float16")
    assert auto.resolve().kv_cache_dtype == "float16" and auto.kv_format.storage_dtype(torch.float32) == torch.float16
    assert EngineConfig(device="cpu", dtype="float32").resolve().kv_cache_dtype == "auto"  # exact float32
    assert EngineConfig(device="cpu", kv_cache_dtype="int8").resolve().kv_cache_dtype == "int8"
    assert EngineConfig(model="random:smollm2-135m", device="cpu").resolve().kv_cache_dtype == "auto"
    monkeypatch.setenv("LLMD_FP16_KV", "0")
    assert EngineConfig(device="cpu").resolve().kv_cache_dtype == "auto"
    monkeypatch.setattr(config_mod, "cpu_has_native_bf16", lambda: True)
    monkeypatch.delenv("LLMD_FP16_KV")
    assert EngineConfig(device="cpu").resolve().kv_cache_dtype == "auto"  # bfloat16 model: its own dtype


@pytest.mark.parametrize("kw,field", [
    ({"kv_cache_dtype": "float16", "kv_rotation": "hadamard"}, "--kv-rotation"),
    ({"kv_cache_dtype": "bfloat16", "kv_scales": (1.0, 1.0)}, "--kv-scales"),
    ({"kv_cache_dtype": "float16", "kv_scale_group_size": 32}, "--kv-scale-group-size"),
    ({"kv_cache_dtype": "float16", "attention_backend": "triton"}, "--attention-backend")])
def test_16bit_float_caches_refuse_what_they_cannot_do(kw, field, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(LlmdError, match=field):
        EngineConfig(device="cpu", dtype="float32", **kw).resolve()


def test_smollm2_16bit_float_caches_within_bounds_of_float32(smollm2, smollm2_tokenizer):
    """Float32 model, teacher-forced first 320 tokens of the kv-quality text, cpu backend: a float16
    cache is within 0.03 % ΔNLL and 99.5 % top-1 of float32 K/V, bfloat16 within 0.1 % and 98 %;
    both hold half the bytes per token, and both were really read (the NLL moved)."""
    from kv_quality_support import engine_kw

    from llmd.daemon.bench.kv_quality import quality_row
    from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT

    ids = smollm2_tokenizer.encode(QUALITY_TEXT)[:320]
    kw = {**engine_kw("float32"), "attention_backend": "cpu"}
    base = quality_row(smollm2[0], smollm2_tokenizer, ids, "auto", **kw)
    for name, max_dnll, min_top1 in (("float16", 0.03, 0.995), ("bfloat16", 0.1, 0.98)):
        row = quality_row(smollm2[0], smollm2_tokenizer, ids, name, base, **kw)
        print(f"{name} KV vs float32: dNLL {row.delta_nll_pct:+.4f} %, top-1 {100 * row.top1:.2f} %")
        assert abs(row.delta_nll_pct) <= max_dnll and row.top1 >= min_top1, (name, row.delta_nll_pct, row.top1)
        assert row.nll != base.nll and 2 * row.bytes_per_token == base.bytes_per_token


def test_engine_with_a_float16_cache_serves_prefix_hits_and_reports_it(smollm2, smollm2_tokenizer):
    """An engine on a float16 cache: the startup line names it, twice the blocks of float32 fit the
    same memory, and a request repeated with its prefix served from the cache gives the same greedy
    tokens as its first run (the fast backend's C decode kernel reads float16 blocks)."""
    from llmd.daemon.core.request import SamplingParams

    kw = dict(device="cpu", dtype="float32", kv_cache_memory=32 * 2**20, threads=torch.get_num_threads())
    f16 = Engine(smollm2[0], smollm2_tokenizer, EngineConfig(kv_cache_dtype="float16", **kw))
    f32 = Engine(smollm2[0], smollm2_tokenizer, EngineConfig(**kw))
    assert "float16, float32 model" in f16.capacity_summary() and f16.num_blocks >= 2 * f32.num_blocks - 2

    def run(eng, prompt):
        rid = eng.add_request(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        tokens, cached = [], None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.request_id == rid:
                    tokens += out.new_token_ids
                    cached = out.num_cached_tokens
        return tokens, cached

    prompt = smollm2_tokenizer.encode("The history of the printing press begins in China, where " * 8)
    first, hit0 = run(f16, prompt)
    again, hit1 = run(f16, prompt)
    assert hit0 == 0 and hit1 >= 16 and again == first
