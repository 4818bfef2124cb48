"""Cases Q1 (teacher-forced top-1 agreement) and Q4 (ΔNLL budgets, > 0, vs an HF fake-quant
reference) on SmolLM2, fixed ~1,000-token text in chunks of 64, store-then-read, in float64 on
the torch reference backend (machine-independent figures: tests/fixtures/kv_quality_support.py).

Measured on this text (962 tokens), float64, 2026-12-02 (each dtype's default --kv-rotation):
  int8 + hadamard  ΔNLL -0.059 %  top-1 98.44 %
  fp8_e4m3         ΔNLL  0.619 %  top-1 93.76 %
  fp8_e5m2         ΔNLL  1.134 %  top-1 85.54 %
  int4 (KIVI)      ΔNLL  0.175 %  top-1 91.88 %
int8 meets the case's bounds (top-1 ≥ 97 %, ΔNLL ≤ 0.2 %); fp8 is reported by the case, and its
bounds below are regression guards under these figures (float32 over 8 jittered runs gave e4m3
0.76 ± 0.15 % / 93.5 ± 0.3 %, e5m2 top-1 85-88 %: the formats' own rounding, HF's fake-quant
lands in the same place). int8 + hadamard lowers the NLL on this text (float32 realizations
scatter around 0: 0.005 ± 0.05 %, and on the long text −0.038 ± 0.030 %), so Q4's "ΔNLL > 0"
is a strict xfail for int8; test_q4_int8_rotated_cache_was_read checks that its cache was read.
Cost: one teacher-forced float64 run ≈ 9 s on 2 threads.
"""

import pytest
import torch
from kv_quality_support import (
    INT8_DNLL_MAX_PCT,
    INT8_TOP1_MIN,
    QUALITY_BACKEND,
    engine_kw,
    float64_copy,
    quality_getter,
    xfail_for,
)

from llmd.daemon.bench.kv_quality import KV_DTYPES, hf_fake_quant, quality_row
from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.request import SamplingParams

TOP1_MIN = {"int8": INT8_TOP1_MIN, "fp8_e4m3": 0.93, "fp8_e5m2": 0.845}
DNLL_MAX_PCT = {"int8": INT8_DNLL_MAX_PCT, "fp8_e4m3": 1.0, "fp8_e5m2": 1.75}
READ_MISS = "int8 + hadamard on SmolLM2: ΔNLL -0.059 % in float64 (the rounding lowers this text's NLL)"


@pytest.fixture(scope="module")
def model64(smollm2):
    """SmolLM2 in float64 for this module (freed after it)."""
    model = float64_copy(smollm2[0])
    yield model
    del model


@pytest.fixture(scope="module")
def quality(model64, smollm2_tokenizer):
    """``(ids, get)``: ``get(name)`` runs one KV dtype in float64 on first use (each test pays for
    its own dtype, so no single test carries all teacher-forced runs)."""
    ids = smollm2_tokenizer.encode(QUALITY_TEXT)
    assert 900 <= len(ids) <= 1100
    return ids, quality_getter(model64, smollm2_tokenizer, ids)


@pytest.mark.parametrize("name", KV_DTYPES[1:])
def test_q1_teacher_forced_top1_agreement(quality, name):
    row = quality[1](name)
    assert row.top1 >= TOP1_MIN[name], row


@pytest.mark.parametrize("name", KV_DTYPES[1:])
def test_q4_delta_nll_budget(quality, name):
    row = quality[1](name)
    assert row.delta_nll_pct <= DNLL_MAX_PCT[name], row


@pytest.mark.parametrize("name", xfail_for(READ_MISS, "int8"))
def test_q4_quantized_cache_was_read(quality, name):
    assert quality[1](name).delta_nll_pct > 0


def test_q4_int8_rotated_cache_was_read(quality):
    """int8's default scheme is rotated (issue 19) and its ΔNLL sits at the noise floor: the
    rows differ from auto's anyway (NLL and some argmaxes), and the rotation is on."""
    row, auto = quality[1]("int8"), quality[1]("auto")
    assert row.kv_rotation == "hadamard" and row.nll != auto.nll and row.top1 < 1.0


def test_q1_int4_teacher_forced_top1_agreement(quality):
    """int4 (KIVI K per channel over 16-token blocks + the 16-bit open-block residual, V per
    token; no rotation by default): top-1 ≥ 90 % (float64: 91.88 %; per-token int4 was 80.96 % in float32)."""
    row = quality[1]("int4")
    assert row.kv_rotation == "none" and row.bytes_per_token > 7_920  # blocks + the residual's share
    assert row.top1 >= 0.90, row


def test_q4_int4_delta_nll_budget_and_cache_was_read(quality):
    """int4's ΔNLL is > 0 (the quantized cache was read) and ≤ 2 % (float64: 0.175 %)."""
    assert 0 < quality[1]("int4").delta_nll_pct <= 2.0, quality[1]("int4")


@pytest.mark.parametrize("name", ["int8"])  # the default 8-bit format; fp8 blocks are cached by the same path
def test_q1_with_prefix_served_from_cache(quality, model64, smollm2_tokenizer, name):
    """Q1 repeated with the first 512 tokens served from the prefix cache (a first request
    computed and cached them; the full request's lookup hits 32 blocks and computes only the
    rest, in the same 64-token chunks): the same NLL and every position's argmax, so the top-1
    agreement of Q1 is what a cached prefix gives too (cached blocks hold the codes and scales
    the cold run read back)."""
    ids, get = quality
    row = quality_row(model64, smollm2_tokenizer, ids, name, get("auto"), cached_prefix=512,
                      attention_backend=QUALITY_BACKEND, **engine_kw())
    cold = get(name)
    assert torch.equal(row.argmax, cold.argmax) and row.nll == cold.nll, (row, cold)


@pytest.fixture(scope="module")
def float64_quality(quality, hf_smollm2):
    """``get(name)`` -> (llmd float64 QualityRow, HF float64 ``(nll, argmax)``), once per dtype.

    Both sides run the same GGUF weights in float64 (llmd's rows are the module's; HF's float32
    model copied and cast, its weights being exact float32 dequantizations). Upstream of each
    quantizer the two implementations then agree to ~1e-15 instead of float32's ~1e-7, so a K/V
    element lands on a different side of a rounding boundary about never instead of thousands
    of times, and what is compared is the quantization itself."""
    ids, get_llmd = quality
    hf = float64_copy(hf_smollm2)
    runs = {}

    def get(name):
        if name not in runs:
            row = get_llmd(name)  # the dtype's default --kv-rotation (hadamard for int8), the same in HF
            runs[name] = (row, hf_fake_quant(hf, ids, name, row.kv_rotation))  # noqa: F821 (deleted after the yield)
        return runs[name]

    get.hf = hf  # for tests on a shorter text (test_q4_int4_matches_hf_kivi_reference_float64)
    yield get
    del hf, get.hf


@pytest.mark.parametrize("name", KV_DTYPES[1:])
def test_q4_matches_hf_fake_quant_reference_float64(float64_quality, name):
    """Q4's agreement with the independent reference, in float64 on both sides: ΔNLL% within
    0.05 pp and ≥ 99 % of positions with the same argmax (measured: |Δ| 0.0005 pp int8,
    0.015 e4m3, 0.000 e5m2; argmax 99.9-100 %)."""
    (base, hf_base), (row, hf_row) = float64_quality("auto"), float64_quality(name)
    assert abs(base.nll - hf_base[0]) < 1e-6
    ref_pct = 100 * (hf_row[0] - hf_base[0]) / hf_base[0]
    assert abs(row.delta_nll_pct - ref_pct) <= 0.05, (name, row.delta_nll_pct, ref_pct)
    assert (row.argmax == hf_row[1]).float().mean().item() >= 0.99


def test_q4_int4_matches_hf_kivi_reference_float64(float64_quality, quality, model64, smollm2_tokenizer):
    """int4 (KIVI) against the independent HF reference with llmd's read rule
    (``kivi_attention_reference``: K per channel over 16-position blocks from the float16-rounded
    keys, each query's own block exact, V per token), float64 on both sides, on the text's first
    320 tokens (20 blocks; chunks of 64 in llmd): NLL within 0.01 % of each other and ≥ 99 % of
    positions with the same argmax (measured 2026-12-01: both NLL 2.554739, every argmax equal;
    the old per-token K fake quantization gives 2.909636, 12 % away, and 72 % of the argmaxes)."""
    from llmd.daemon.bench.kv_quality import nll_and_argmax

    ids = quality[0][:320]
    engine = Engine(model64, smollm2_tokenizer,
                    EngineConfig(kv_cache_dtype="int4", attention_backend=QUALITY_BACKEND, **engine_kw("float64")))
    nll, top = nll_and_argmax(engine.teacher_forced_logits(ids, 64), ids)
    hf_nll, hf_top = hf_fake_quant(float64_quality.hf, ids, "int4", engine.config.kv_rotation)
    assert abs(nll - hf_nll) <= 1e-4 * hf_nll, (nll, hf_nll)
    assert (top == hf_top).float().mean().item() >= 0.99


FREE_PROMPTS = ["The history of Rome", "How do plants make food?", "Write a haiku about rain.",
                "List three prime numbers:", "The best way to learn programming is",
                "Once upon a time, in a small village,", "Explain gravity to a child.", "The recipe for pancakes:",
                "def add(a, b):", "My favourite season is"]


def repeated_8grams(toks: list[int]) -> int:
    grams = [tuple(toks[i : i + 8]) for i in range(len(toks) - 7)]
    return len(grams) - len(set(grams))


@pytest.fixture(scope="module")
def free_running_auto(make_engine):
    params = SamplingParams(max_tokens=64, temperature=0)
    return [r["token_ids"] for r in make_engine().generate(FREE_PROMPTS, params)]


@pytest.mark.parametrize("name", KV_DTYPES[1:])
def test_q1_free_running_no_degeneration(make_engine, free_running_auto, name):
    """Q1 free-running greedy (10 prompts, 64 tokens): no quantized run is > 2× the model-dtype
    run's length, and no quantized run (10 prompts) repeats 8-grams more often than the model-dtype
    run does."""
    params = SamplingParams(max_tokens=64, temperature=0)
    runs = [r["token_ids"] for r in make_engine(kv_cache_dtype=name).generate(FREE_PROMPTS, params)]
    for base, quant in zip(free_running_auto, runs):
        assert len(quant) <= 2 * len(base)
    # per run (all 10 prompts): single prompts may loop differently after a near-tie flip
    assert sum(map(repeated_8grams, runs)) <= sum(map(repeated_8grams, free_running_auto)), name


def test_q1_q4_bounds_with_32_channel_scales(quality, model64, smollm2_tokenizer):
    """Cases Q1/Q4 for ``--kv-scale-group-size 32`` (int8 with the default hadamard rotation, the
    shipped grouped option) on SmolLM2: int8's bounds hold (README "Quantized KV cache")."""
    ids, get = quality
    row = quality_row(model64, smollm2_tokenizer, ids, "int8", get("auto"), attention_backend=QUALITY_BACKEND,
                      kv_scale_group_size=32, **engine_kw())
    assert row.label == "int8/g32+hadamard" and row.bytes_per_token == 12_960
    assert abs(row.delta_nll_pct) <= DNLL_MAX_PCT["int8"] and row.top1 >= TOP1_MIN["int8"], row
