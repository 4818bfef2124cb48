"""int4 KV (KIVI K per block and channel + the open block's 16-bit residual; V per token):
the torch reference and the cpu fast path against the float64 oracle of the read rule, chunk-size
invariance of what is read and stored, and the format's rounding (tests/fixtures/kivi_steps.py)."""

from __future__ import annotations

import pytest
import torch
from kivi_steps import BS, make_seqs, oracle, run_steps

from llmd.quant.kv import dequantize_k_blocks, quantize_k_blocks, unpack_int4

LENGTHS = [1, 16, 37, 70]  # a context of 1, one full block, non-multiples of the block size


def _chunked(lengths, chunk):
    """Steps: every sequence prefilled in ``chunk``-token chunks side by side (then decodes: a
    chunk of 1), so steps mix prefill chunks and decodes and cross block boundaries."""
    steps, done = [], [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        step = []
        for i, n in enumerate(lengths):
            if done[i] < n:
                c = min(chunk if done[i] < n // 2 else 1, n - done[i])  # second half: decodes
                step.append((i, c))
                done[i] += c
        steps.append(step)
    return steps


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("backend,dtype,tol", [("torch", torch.float64, 1e-12), ("torch", torch.float32, 2e-6),
                                               ("cpu", torch.float32, 2e-6), ("cpu", torch.bfloat16, 2e-2)])
def test_int4_paths_match_the_float64_oracle(backend, dtype, tol, window):
    seqs = make_seqs(LENGTHS, 32, dtype)
    outs, _, _ = run_steps(seqs, _chunked(LENGTHS, 7), backend, dtype, window)
    for got, want in zip(outs, oracle(seqs, window, model_dtype=dtype)):
        assert _rel(got, want) <= tol


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_int4_reads_and_bytes_do_not_depend_on_chunking(backend):
    """S1 at the kernel level: chunks of 70 (whole prompts), 5 and 16, and one token at a time,
    give the same outputs at every position and the same bytes in every full block."""
    seqs = make_seqs(LENGTHS, 32, torch.float64, seed=3)
    runs = [run_steps(seqs, _chunked(LENGTHS, c), backend, torch.float64) for c in (70, 5, 16, 1)]
    want = oracle(seqs)
    for outs, cache, tables in runs:
        for got, w in zip(outs, want):
            assert _rel(got, w) <= 1e-12
    base_cache, base_tables = runs[0][1], runs[0][2]
    for _, cache, tables in runs[1:]:
        for i, n in enumerate(LENGTHS):
            ids = tables[i, : n // BS].long()
            assert torch.equal(cache.data[0, ids], base_cache.data[0, base_tables[i, : n // BS].long()])
            assert torch.equal(cache.k_scale()[ids], base_cache.k_scale()[base_tables[i, : n // BS].long()])
            assert torch.equal(cache.k_zero()[ids], base_cache.k_zero()[base_tables[i, : n // BS].long()])


def test_int4_with_hadamard_rotation_matches_the_oracle():
    seqs = make_seqs([40, 19], 64, torch.float64, seed=5)
    outs, _, _ = run_steps(seqs, _chunked([40, 19], 9), "cpu", torch.float64, rotation="hadamard")
    for got, want in zip(outs, oracle(seqs, rotation="hadamard", model_dtype=torch.float64)):
        assert _rel(got, want) <= 1e-12


def test_k_blocks_quantize_per_channel_with_scale_and_zero_point():
    """Codes 0..15, scale = (max - min) / 15 and zero = min in float16 per (block, head,
    channel); the extremes of each channel come back within half a step."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, BS, 2, 32, generator=g) * torch.linspace(0.1, 20, 32)).to(torch.float16)
    codes, scale, zero = quantize_k_blocks(x)
    assert codes.dtype == torch.uint8 and codes.shape == (3, BS, 2, 16)
    assert scale.dtype == torch.float16 and scale.shape == (3, 2, 32) and zero.shape == (3, 2, 32)
    c = unpack_int4(codes).int() + 8
    assert c.min() >= 0 and c.max() <= 15
    assert torch.equal(zero, x.float().amin(1).half())
    back = dequantize_k_blocks(codes, scale, zero, torch.float64)
    assert ((back - x.double()).abs() <= scale.double()[:, None] / 2 + 1e-3 * x.double().abs()).all()
    assert ((back - x.double()).abs() <= scale.double()[:, None] * 0.51 + 0.01).all()
