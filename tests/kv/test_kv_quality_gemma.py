"""Cases Q1 (teacher-forced top-1 agreement) and Q4 (ΔNLL budgets, > 0, vs an HF fake-quant
reference) on Gemma 3 270M: the Gemma half of tests/kv/test_kv_quality.py (same fixed text,
chunks of 64, store-then-read through the engine's runner and per-group block tables: layers
5/11/17 global, the others a sliding window of 512 < the text's 952 tokens).

Each dtype's llmd run is computed once per module, on first use, so each test pays for its own
dtype: ~14 s per float64 run on 2 threads (mostly the 262k-entry LM head over 952 positions), on
top of the session's model loads (see tests/fixtures/gemma_fixtures.py).
"""

import pytest
from kv_quality_support import INT8_DNLL_MAX_PCT, float64_copy, quality_getter

from llmd.daemon.bench.kv_quality import KV_DTYPES, hf_fake_quant
from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # first tests here may load llmd's and HF's Gemma

# Measured on this text (952 Gemma tokens), float64 on the torch backend, 2026-12-02 (each dtype's
# default --kv-rotation; machine-independent: tests/fixtures/kv_quality_support.py):
#   int8 + hadamard  ΔNLL 0.059 %  top-1 97.06 %
#   fp8_e4m3         ΔNLL 1.024 %  top-1 93.80 %
#   fp8_e5m2         ΔNLL 4.712 %  top-1 89.48 %
#   int4 (KIVI)      ΔNLL 3.482 %  top-1 91.80 %  (reported, not run here: README)
# int8 meets Gemma's case bounds (top-1 ≥ 96.5 %, ΔNLL ≤ 0.2 %, > 0): the rotation spreads K's
# outlier channels (without it, float32: 1.175 % / 94.74 %; Gemma's K after k_norm and RoPE has
# amax/rms 6-11 per token, so int8's uniform step amax/127 is as coarse as e4m3's mantissa). fp8
# is reported by the case; its bounds are regression guards under these figures (HF
# transformers' own Gemma3 with K/V fake-quantized from the spec lands in the same place: float32
# HF 1.324 % / 4.311 %, over 6 jittered runs e4m3 0.71 ± 0.27 %, e5m2 5.1 ± 0.8 %). fp8 keeps the
# rotation off by default: with it, e4m3 2.444 % / 91.90 % and e5m2 13.508 % / 83.91 % (float32).
# int4's short-text 3.48 % misses Q4's 2 % (the HF KIVI reference gives the same, 3.333 % in
# float32); on the long text over 3 jittered runs it is 1.111 ± 0.147 % (README), and a Gemma run
# here costs ~14 s, so int4 on Gemma is reported in the README, not asserted.
TOP1_MIN = {"int8": 0.965, "fp8_e4m3": 0.93, "fp8_e5m2": 0.885}
DNLL_MAX_PCT = {"int8": INT8_DNLL_MAX_PCT, "fp8_e4m3": 1.5, "fp8_e5m2": 6.0}


@pytest.fixture(scope="module")
def quality(gemma3, gemma3_tokenizer):
    """``(ids, get)``: ``get(name)`` runs llmd's teacher-forced pass for one KV dtype on first use,
    on a float64 copy of the session's Gemma (freed after the module)."""
    ids = gemma3_tokenizer.encode(QUALITY_TEXT)
    assert 900 <= len(ids) <= 1100 and len(ids) > 512  # past the sliding window
    model = float64_copy(gemma3[0])
    yield ids, quality_getter(model, gemma3_tokenizer, ids)
    del model


@pytest.mark.parametrize("name", KV_DTYPES[1:])
def test_q1_teacher_forced_top1_agreement(quality, name):
    row = quality[1](name)
    assert row.top1 >= TOP1_MIN[name], row


@pytest.mark.parametrize("name", KV_DTYPES[1:])
def test_q4_delta_nll_budget(quality, name):
    row = quality[1](name)
    assert row.delta_nll_pct <= DNLL_MAX_PCT[name], row


@pytest.mark.parametrize("name", KV_DTYPES[1:])
def test_q4_quantized_cache_was_read(quality, name):
    assert quality[1](name).delta_nll_pct > 0


def test_hf_reference_path_keeps_sliding_window(quality, hf_gemma3):
    """The HF fake-quant path without quantization (float64, HF's float32 Gemma copied and cast)
    equals llmd's model-dtype run (which equals HF's own Gemma 3, case L2): HF builds the
    sliding-window masks for the registered attention function and passes the layer's scaling.
    Without the mask function registered, HF skips the masks and every layer attends globally
    (NLL 3.37 instead of 1.82 on this text)."""
    hf = float64_copy(hf_gemma3)
    nll, top = hf_fake_quant(hf, quality[0], "auto")
    del hf
    auto = quality[1]("auto")
    assert abs(nll - auto.nll) < 1e-6, (nll, auto.nll)
    assert (top == auto.argmax).float().mean().item() >= 0.999


# Q4's agreement with the HF fake-quant reference on Gemma is not re-run here (≈ 4 min of CI for
# the float64 pair of every dtype): in float64 on both sides they agree to 0.000 pp for every
# dtype (`llmd bench kv-quality --model gemma3-270m --dtype float64 --hf-reference`, README). The
# float64 agreement test runs on SmolLM2 (tests/kv/test_kv_quality.py).
