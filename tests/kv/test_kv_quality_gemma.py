"""Cases Q1 (teacher-forced top-1 agreement) and Q4 (ΔNLL budgets, > 0, vs an HF fake-quant
reference) on Gemma 3 270M: the Gemma half of tests/kv/test_kv_quality.py (same fixed text,
chunks of 64, store-then-read through the engine's runner and per-group block tables: layers
5/11/17 global, the others a sliding window of 512 < the text's 952 tokens).

Each dtype's llmd run and HF fake-quant run are computed once per module, on first use, so
each test pays for its own dtype. Cost on 1 thread: ~30 s per llmd run and ~30 s per HF
forward (both mostly the 262k-entry LM head over 952 positions), on top of the session's
model loads (see tests/fixtures/gemma_fixtures.py).
"""

import pytest
from kv_quality_support import DNLL_MAX_PCT, TOP1_MIN, one_torch_thread, quality_getter, xfail_for  # noqa: F401 (fixture)

from llmd.daemon.bench.kv_quality import KV_DTYPES, hf_fake_quant
from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # first tests here may load llmd's and HF's Gemma

# Measured on this text (952 Gemma tokens), float32 on CPU, torch backend, since Q/K/V and
# gate/up are fused at load time (issue 13: a new realization of the rounding noise below):
#   int8      ΔNLL 1.175 %  top-1 94.74 %   (before the fusion 1.040 % / 94.43 %; HF fake-quant ΔNLL 1.194 %)
#   fp8_e4m3  ΔNLL 0.659 %  top-1 93.48 %   (before 0.881 % / 93.59 %; HF 1.324 %)
#   fp8_e5m2  ΔNLL 4.856 %  top-1 88.75 %   (before 4.984 % / 89.38 %; HF 4.311 %)
# HF transformers' own Gemma3 with K/V fake-quantized from the spec lands in the same place, so
# these are the formats under per-(token, KV head) amax scaling on this model, not llmd. The
# loss is K's (HF, K alone: int8 ΔNLL 1.12 % top-1 94.1 %, e5m2 4.92 % 89.2 %; V alone: int8
# 0.007 % 98.5 %, e5m2 0.51 % 95.9 %). Gemma's K (after k_norm and RoPE, one KV head of 256
# dims) has amax/rms 6-11 per token (median by layer; ≈ 3 for Gaussian data), so int8's
# uniform step amax/127 is as coarse as e4m3's 3-bit mantissa. Over 6 HF fake-quant runs with
# 1e-6 relative K/V jitter before quantizing: int8 ΔNLL 0.95 ± 0.18 % (0.74-1.13) top-1
# 94.2 ± 0.3 %; e4m3 0.71 ± 0.27 % (0.42-1.08) top-1 93.9 ± 0.3 %; e5m2 5.1 ± 0.8 % (3.8-6.1)
# top-1 88.9 ± 0.6 %. So int8 and e5m2 miss their bounds in expectation, e4m3's ΔNLL bound
# sits at the mean and its top-1 bound just above it (a coin flip per realization), and the
# 0.05 pp agreement with an independent implementation is far below the measure's noise. Strict
# xfails, so any change in the numbers forces these marks to be revisited.
# Issue 19: int8 now runs with its default --kv-rotation hadamard (RoPE(K)·H stored, the query
# rotated the same way): ΔNLL 0.213 %, top-1 97.06 % on this text (without: 1.175 % / 94.74 %).
# The rotation spreads K's outlier channels, so int8 meets Gemma's top-1 bound (96.5 %, case Q1)
# and misses its ΔNLL budget (0.2 %) by 0.013 pp, inside one realization's noise (±0.18 pp).
# On the >= 2,000-token text over 4 jittered realizations (`llmd bench kv-quality --model
# gemma3-270m --dtype float32 --attention-backend torch --threads 1 --kv-cache-dtype int8 --text
# long --jitter-runs 4`) int8 + hadamard is 0.078 ± 0.024 % (max 0.099 %), top-1 97.40 ± 0.05 %:
# the budget is met in expectation; this single short-text realization stays a strict xfail.
# fp8 keeps the rotation off by default: with it, e4m3 2.444 % / 91.90 % and e5m2 13.508 % /
# 83.91 % (worse: a float format's relative precision does not gain from a flatter vector).
TOP1_MIN_GEMMA = {**TOP1_MIN, "int8": 0.965}
TOP1_MISS = ("fp8 rounding on Gemma 3 (per-(token, head) amax over 256 dims, K amax/rms 6-11): top-1 "
             "e4m3 93.48 %, e5m2 88.75 % (HF fake-quant: 94.11, 88.43 %)")
DNLL_MISS = ("K rounding on Gemma 3: ΔNLL int8 + hadamard 0.213 % vs 0.2 % on this text (0.078 ± 0.024 % on "
             "the long one over 4 jittered runs), e5m2 4.856 % vs 3 % (e4m3 0.659 % passes "
             "its 0.75 %) (HF fake-quant without rotation: 1.194, 1.324, 4.311 %)")




@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs with one torch thread (kv_quality_support)."""


@pytest.fixture(scope="module")
def quality(gemma3, gemma3_tokenizer):
    """``(ids, get)``: ``get(name)`` runs llmd's teacher-forced pass for one KV dtype on first use."""
    ids = gemma3_tokenizer.encode(QUALITY_TEXT)
    assert 900 <= len(ids) <= 1100 and len(ids) > 512  # past the sliding window
    return ids, quality_getter(gemma3[0], gemma3_tokenizer, ids)


@pytest.fixture(scope="module")
def hf_quality(quality, hf_gemma3):
    """``get(name)``: HF transformers' ``(nll, argmax)`` with K/V fake-quantized, once per dtype
    (``auto``: the same attention path without quantization, the reference's base)."""
    ids = quality[0]
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = hf_fake_quant(hf_gemma3, ids, name)
        return runs[name]

    return get


@pytest.mark.parametrize("name", xfail_for(TOP1_MISS, "fp8_e4m3", "fp8_e5m2"))
def test_q1_teacher_forced_top1_agreement(quality, name):
    row = quality[1](name)
    assert row.top1 >= TOP1_MIN_GEMMA[name], row


@pytest.mark.parametrize("name", xfail_for(DNLL_MISS, "int8", "fp8_e5m2"))
def test_q4_delta_nll_budget(quality, name):
    row = quality[1](name)
    assert row.delta_nll_pct <= DNLL_MAX_PCT[name], row


@pytest.mark.parametrize("name", KV_DTYPES[1:])
def test_q4_quantized_cache_was_read(quality, name):
    assert quality[1](name).delta_nll_pct > 0


def test_hf_reference_path_keeps_sliding_window(quality, hf_quality):
    """The HF fake-quant path without quantization equals llmd's model-dtype run (which equals
    HF's own Gemma 3, case L2): HF builds the sliding-window masks for the registered attention
    function and passes the layer's scaling. Without the mask function registered, HF skips the
    masks and every layer attends globally (NLL 3.37 instead of 1.82 on this text)."""
    nll, top = hf_quality("auto")
    auto = quality[1]("auto")
    assert abs(nll - auto.nll) < 1e-4, (nll, auto.nll)
    assert (top == auto.argmax).float().mean().item() >= 0.999


# Q4's agreement with the HF fake-quant reference on Gemma is not re-run here (≈ 4 min of CI for
# the float64 pair): in float32 the two differ by 0.154 / 0.442 / 0.673 pp (int8 / e4m3 / e5m2),
# the chaos described above; in float64 on both sides they agree to 0.000 pp for every dtype
# (`llmd bench kv-quality --model gemma3-270m --dtype float64 --hf-reference`, README). The
# float64 agreement test runs on SmolLM2 (tests/kv/test_kv_quality.py).
