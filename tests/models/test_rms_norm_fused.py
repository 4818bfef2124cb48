"""RMSNorm's one-kernel form for steps of at most 4 tokens of 16-bit inputs of a square ``dim``
(``models/layers.py``: weight normalization of ``[x, c₁, c₂, c₃]``): which steps, dims and dtypes
take it, and its outputs against ``F.rms_norm`` (the nine-kernel form every other step keeps):
≤ 1 ulp apart and equal on all but ≤ 2e-4 of elements (measured ~1e-5), on SmolLM2's 576 and a
64-wide per-head shape, 512 rows (in steps of 1 / 3 / 4 tokens), input scales 1e-4 (mean(x²)
far below eps: a pad that carried eps to only 2e-5 flipped 1.6e-3 of them) to 30, strided 3-D
inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmd.models.layers import GemmaRMSNorm, RMSNorm


def test_fused_form_only_where_sqrt_dim_is_exact():
    assert RMSNorm(576, 1e-5, torch.bfloat16)._fused_dtypes == {torch.bfloat16, torch.float16}
    assert RMSNorm(4096, 1e-5, torch.bfloat16)._fused_dtypes == {torch.bfloat16, torch.float16}
    assert RMSNorm(640, 1e-6, torch.bfloat16)._fused_dtypes == set()  # not a square
    assert RMSNorm(128, 1e-6, torch.bfloat16)._fused_dtypes == set()
    assert RMSNorm(289 ** 2, 1e-6, torch.bfloat16)._fused_dtypes == {torch.float16}  # 289 needs 9 bits
    with torch.device("meta"):  # the weights cache builds the module tree on meta
        assert RMSNorm(576, 1e-5, torch.bfloat16)._fused_dtypes


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's last place."""
    spacing = torch.nextafter(b.abs(), torch.tensor(float("inf"), dtype=b.dtype)) - b.abs()
    return (a.double() - b.double()).abs() / spacing.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,step,scale", [(576, 1, 1.0), (576, 3, 30.0), (576, 4, 2.0), (576, 4, 1e-4),
                                            (64, 4, 1.0)])
def test_fused_form_matches_f_rms_norm_within_one_ulp(dtype, dim, step, scale):
    g = torch.Generator().manual_seed(dim + step)
    eps = 1e-5
    norm = RMSNorm(dim, eps, dtype)
    assert dtype in norm._fused_dtypes
    x = (torch.randn(512, dim, generator=g) * scale).to(dtype)

    def fused(t: torch.Tensor) -> torch.Tensor:  # decode-size steps of `step` tokens
        return torch.cat([norm(t[i : i + step]) for i in range(0, t.shape[0], step)])

    norm.weight.data.fill_(1.0)  # the normalized values themselves
    out, base = fused(x), F.rms_norm(x, (dim,), eps=eps)
    assert (step, dtype, x.device) in norm._columns  # the fused form ran
    assert out.dtype == dtype and out.shape == x.shape
    assert _ulps(out, base).max() <= 1 and (out != base).double().mean() <= 2e-4
    norm.weight.data.copy_(torch.randn(dim, generator=g).to(dtype))  # then w * that, rounded once more
    out, base = fused(x), norm.weight * F.rms_norm(x, (dim,), eps=eps)
    assert _ulps(out, base).max() <= 2 and (out != base).double().mean() <= 4e-4


def test_steps_of_more_tokens_keep_f_rms_norm_exactly():
    norm = RMSNorm(576, 1e-5, torch.bfloat16)
    norm.weight.data.normal_()
    x = (torch.randn(5, 576) * 2).to(torch.bfloat16)
    assert torch.equal(norm(x), norm.weight * F.rms_norm(x, (576,), eps=1e-5)) and not norm._columns


def test_fused_form_on_strided_3d_inputs():
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, 1e-6, torch.bfloat16)
    norm.weight.data.copy_(torch.randn(64, generator=g).to(torch.bfloat16))
    qk = torch.randn(2, 12, 64, generator=g).to(torch.bfloat16)[:, :9]  # a per-head slice (Qwen3's q_norm)
    out = norm(qk)
    assert out.shape == (2, 9, 64) and (18, torch.bfloat16, qk.device) in norm._columns
    base = norm.weight * F.rms_norm(qk, (64,), eps=1e-6)
    assert ((out.float() - base.float()).abs() / base.float().abs()).max() <= torch.finfo(torch.bfloat16).eps


def test_float32_and_gemma_keep_f_rms_norm():
    x = torch.randn(3, 576)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.weight.data.normal_()
    assert torch.equal(norm(x), F.rms_norm(x, (576,), norm.weight, 1e-5))
    gemma = GemmaRMSNorm(576, 1e-6, torch.bfloat16)
    gemma.weight.data.normal_()
    xb = x.to(torch.bfloat16)
    assert torch.equal(gemma(xb), F.rms_norm(xb, (576,), gemma.weight, 1e-6))
