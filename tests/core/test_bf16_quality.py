"""bfloat16 on CPU (the ``--dtype auto`` choice on CPUs with native bf16): its own quality
bounds against the float32 model, teacher-forced on the kv-quality text (962 tokens, chunks of
64, fast CPU attention backend, auto KV cache): ΔNLL ≤ 0.1 % and top-1 agreement ≥ 96 %
(issue 13; HF transformers measured +0.04 % and 97.1 % for the same pair, +0.064 % / 96.98 % with
eager attention on an AVX-512/AMX CPU, 2026-12-02). llmd measured +0.023 % / 96.67 % there, since
the fast backend computes a bfloat16 model's scores in float32 (kernels/cpu_attention.py; with
bfloat16 scores it was +0.128 %, over the bound). Greedy tokens of bfloat16 and float32 runs
diverge, which is why exact-token tests pin float32.

Where the CPU has no native bfloat16 (AVX2-only, e.g. AMD Zen 1-3) ``--dtype auto`` runs float32,
and the bfloat16 matmuls are emulated: the test took 43 s there (2026-12-06, Zen 3) instead of
~10 s, so it runs only where bfloat16 is the default it checks (CI draws both kinds of machine).
"""

from __future__ import annotations

import pytest
import torch
from kv_quality_support import engine_kw

from llmd.daemon.bench.kv_quality import quality_row
from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT
from llmd.daemon.core.config import cpu_has_native_bf16

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bfloat16 on this CPU: --dtype auto "
                                 "runs float32 here (and emulated bfloat16 is 4x slower)")]

BF16_DNLL_MAX_PCT = 0.1
BF16_TOP1_MIN = 0.96


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_path):
    """SmolLM2 loaded in bfloat16 (the weights as ``--dtype bfloat16`` / auto load them)."""
    from llmd.models.gguf_loader import load_model

    return load_model(smollm2_path, torch.bfloat16, "cpu")[0]


def test_bfloat16_within_its_bounds_of_float32(smollm2, smollm2_bf16, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(QUALITY_TEXT)
    base = quality_row(smollm2[0], smollm2_tokenizer, ids, "auto", attention_backend="cpu", **engine_kw("float32"))
    bf16 = quality_row(smollm2_bf16, smollm2_tokenizer, ids, "auto", base, attention_backend="cpu",
                       **engine_kw("bfloat16"))
    assert bf16.delta_nll_pct <= BF16_DNLL_MAX_PCT, bf16
    assert bf16.top1 >= BF16_TOP1_MIN, bf16
    assert bf16.delta_nll_pct != 0.0 and bf16.top1 < 1.0  # really a different dtype
