"""Float32 scores of bfloat16 queries and keys by VDPBF16PS (``kernels/native/bf16_scores.c`` via
``kernels/cpu_scores.py``), and the same with the softmax fused: against float64 on random shapes
and masks (measured ≤ 1.4e-7 relative to the largest score), against torch's softmax, the
unexpanded mask, the layouts they refuse, and the cpu backend's prefill / mixed / cascade steps
with them on and off."""

from __future__ import annotations

import random

import pytest
import torch
from test_cpu_attention import make_step, rel

from llmd.kernels import cpu_attention, cpu_scores, ops, reference
from llmd.kernels.native import build

pytestmark = pytest.mark.skipif(not cpu_scores.available(), reason=f"no bf16 scores kernel: {build.scores_why_not}")


def _ref(q, k, scale, bias, div):
    s = scale * torch.bmm(q.double(), k.double().transpose(1, 2))
    if bias is not None:
        b, m = q.shape[0], q.shape[1]
        s += bias.double().repeat_interleave(div, 0).repeat(1, m // bias.shape[1], 1)[:b]
    return s


def test_random_shapes_match_float64():
    """40 random shapes: batch 1-6, rows 1-70 (register-block tails), keys 1-100 (tile tails),
    head_dim 2-256, with and without a mask shared over entries and repeating over rows; the
    output's strided rows, and a -inf mask entry stays -inf."""
    rng = random.Random(0)
    for it in range(40):
        g = torch.Generator().manual_seed(it)
        div, reps = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
        b, r, n = div * rng.randint(1, 2), rng.randint(1, 24), rng.randint(1, 100)
        m, d = r * reps, rng.choice([2, 32, 64, 96, 128, 256])
        q = (torch.randn(b, m, d, generator=g) * 3).bfloat16()
        k = torch.randn(b, n, d, generator=g).bfloat16()
        bias = None if it % 4 == 0 else torch.randn(b // div, r, n, generator=g)
        if bias is not None:
            bias[..., -1] = float("-inf")
        out = torch.full((b, m, n + 3), float("nan"))[..., :n]  # rows strided
        assert cpu_scores.scores(q, k, 0.3, bias, out, div)
        ref = _ref(q, k, 0.3, bias, div)
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(out))
        err = (out.double() - ref)[finite].abs().max() / ref[finite].abs().max()
        assert err <= 1e-6, (it, b, m, n, d, float(err))


def test_fused_softmax_matches_torch_and_float64():
    """probs: 20 random shapes with masks (30 % -inf, key 0 always visible) and one row masked
    whole: within bfloat16 rounding of the float64 softmax, the same bits as torch's float32
    softmax cast to bfloat16 on ≥ 99.9 % of elements (measured 99.999 %: the exponential differs
    by an ulp), the log-sum-exp within 1e-5 of float64's, zeros and -inf for the masked row."""
    rng = random.Random(3)
    same = total = 0
    for it in range(20):
        g = torch.Generator().manual_seed(100 + it)
        div, reps = rng.choice([1, 3]), rng.choice([1, 3])
        b, r, n, d = div * rng.randint(1, 2), rng.randint(1, 20), rng.randint(1, 300), rng.choice([32, 64, 128])
        m = r * reps
        q, k = (torch.randn(b, m, d, generator=g) * 2).bfloat16(), torch.randn(b, n, d, generator=g).bfloat16()
        bias = torch.zeros(b // div, r, n).masked_fill_(torch.rand(b // div, r, n, generator=g) < 0.3, float("-inf"))
        bias[..., 0] = 0
        if it == 0:
            bias[0, 0] = float("-inf")
        out, lse = torch.empty(b, m, n, dtype=torch.bfloat16), torch.empty(b, m)
        assert cpu_scores.probs(q, k, 0.125, bias, out, div, lse)
        s = _ref(q, k, 0.125, bias, div)
        ref = torch.softmax(s, -1).nan_to_num(0.0)
        assert ((out.double() - ref).abs() <= ref * 2**-8 + 1e-30).all(), it
        tb = torch.softmax(s.float(), -1).nan_to_num(0.0).bfloat16()
        same, total = same + int((out == tb).sum()), total + out.numel()
        want = torch.logsumexp(s, -1)
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(lse)) and (lse.double() - want)[fin].abs().max() <= 1e-5
        if it == 0:
            assert out[0, 0].abs().sum() == 0 and lse[0, 0] == float("-inf")
    assert same / total >= 0.999, same / total


def test_refused_layouts_leave_the_output_untouched():
    q, k = torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 5, 64).bfloat16()
    out = torch.zeros(2, 4, 5)
    for args in ((q.float(), k), (q, k.float()), (q, k[:, :, :63]), (q.transpose(1, 2), k),
                 (torch.randn(2, 4, 258).bfloat16(), torch.randn(2, 5, 258).bfloat16())):
        assert not cpu_scores.scores(*args, 1.0, None, out)
    assert not cpu_scores.scores(q, k, 1.0, torch.zeros(2, 3, 5), out)  # 3 rows do not divide 4
    assert not cpu_scores.scores(q, k, 1.0, None, torch.zeros(2, 4, 5, dtype=torch.float64))
    assert out.abs().sum() == 0
    p16 = torch.zeros(2, 4, 5, dtype=torch.bfloat16)
    assert not cpu_scores.probs(q, k, 1.0, None, p16.float())  # probabilities are bfloat16
    assert not cpu_scores.probs(q, k, 1.0, None, p16, lse=torch.zeros(2, 5))  # lse is [B, M]
    assert p16.abs().sum() == 0


@pytest.mark.parametrize("kind,fmt,window", [("prefill", "auto", None), ("mixed", "int8", 40),
                                             ("spread-mixed", "fp8_e4m3", None), ("prefill", "auto", 24)])
def test_cpu_backend_steps_with_the_kernel_on_and_off(kind, fmt, window, monkeypatch):
    """A bfloat16 step's prefill chunks score through the kernels (scores + softmax fused for
    ``auto`` caches, scores alone for int8/fp8); the output stays within the backend's bfloat16
    tolerance of float64 and within bfloat16 rounding of the float32-baddbmm path."""
    case = {"kind": kind, "group": 3, "block_size": 16, "head_dim": 64, "fmt": fmt, "window": window,
            "dtype": torch.bfloat16}
    calls = []
    for name in ("scores", "probs"):  # probs: auto caches (no scales); scores: int8 / fp8
        real = getattr(cpu_scores, name)
        monkeypatch.setattr(cpu_scores, name, lambda *a, _real=real, **kw: calls.append(a[1].dtype) or _real(*a, **kw))
    meta, query, cache = make_step(case, seed=11)
    q = query.bfloat16()
    on = ops.paged_attention(q, cache, meta, 0.125, window)
    assert calls and set(calls) == {torch.bfloat16}
    ref = reference.paged_attention(q.double(), cache, meta, 0.125, window, compute_dtype=torch.float64)
    assert rel(on, ref) <= 2e-2
    try:
        cpu_scores.set_enabled(False)
        meta2, _, _ = make_step(case, seed=11)
        n = len(calls)
        off = ops.paged_attention(q, cache, meta2, 0.125, window)
        assert len(calls) == n or not cpu_scores.available()
    finally:
        cpu_scores.set_enabled(True)
    assert rel(on, off) <= 4e-3


def test_grouped_scales_keep_float32_keys():
    """``--kv-scale-group-size`` dequantizes K in the gather: those keys stay float32."""
    case = {"kind": "prefill", "group": 3, "block_size": 16, "head_dim": 64, "fmt": "int8", "scale_group": 32,
            "window": None, "dtype": torch.bfloat16}
    meta, query, cache = make_step(case, seed=2)
    assert not cpu_attention.bf16_keys(cache, 64)
    out = ops.paged_attention(query.bfloat16(), cache, meta, 0.125)
    ref = reference.paged_attention(query.double(), cache, meta, 0.125, compute_dtype=torch.float64)
    assert rel(out, ref) <= 2e-2
