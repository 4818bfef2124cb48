"""torch's CPU flash kernel without a mask (``kernels/cpu_flash.py``): float32 prefill chunks
(the chunk's own keys causally, the cached prefix unmasked, merged by log-sum-exp) and a bfloat16
cascade's shared prefix."""

from __future__ import annotations

import pytest
import torch
from test_cpu_attention import make_step, rel

from llmd.kernels import cpu_attention, cpu_flash, ops, reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # the backend's tolerances (test_cpu_attention.py)


def _spy(monkeypatch) -> list:
    calls = []
    real = cpu_attention._flash_chunk
    monkeypatch.setattr(cpu_attention, "_flash_chunk", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_chunks_with_and_without_a_cached_prefix_match_float64(dtype, group, monkeypatch):
    """float32 chunks of 21 (no prefix), 17 (45 cached) and 40 (60-200 cached) query tokens, each
    through the flash path, within the backend's tolerance of the float64 reference."""
    calls = _spy(monkeypatch)
    case = {"kind": "prefill", "group": group, "block_size": 16, "head_dim": 64, "fmt": "auto", "window": None,
            "dtype": dtype}
    meta, query, cache = make_step(case, seed=group)
    q = query.to(dtype)
    out = ops.paged_attention(q, cache, meta, 0.125)
    assert sorted(calls) == [17, 21, 40]
    ref = reference.paged_attention(q.double(), cache, meta, 0.125, None, compute_dtype=torch.float64)
    assert out.dtype == dtype and rel(out, ref) <= TOL[dtype]
    per_chunk = [(0, 21), (21, 38), (38, 78)]
    for a, b in per_chunk:  # every chunk on its own, not only the step's norm
        assert rel(out[a:b], ref[a:b]) <= TOL[dtype]


def test_the_merge_of_prefix_and_chunk_matches_one_softmax():
    """``chunk_attention`` on bare tensors: a 64-token chunk after 100 cached keys equals the softmax
    over all 164 keys with the bottom-right causal mask, in float32 to 1e-5."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((64, 8, 32), (2, 164, 32), (2, 164, 32)))
    out = cpu_flash.chunk_attention(q, k, v, 0.2)
    kk, vv = (t.double().repeat_interleave(4, 0) for t in (k, v))
    s = q.double().transpose(0, 1) @ kk.transpose(1, 2) * 0.2
    visible = torch.arange(164)[None, :] <= (100 + torch.arange(64))[:, None]
    want = (torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ vv).transpose(0, 1)
    assert rel(out, want) <= 1e-5


@pytest.mark.parametrize("why", ["window", "int8", "short", "off", "bfloat16"])
def test_what_the_flash_path_leaves_to_the_others(why, monkeypatch):
    """Sliding windows, scaled (int8) caches, chunks under FLASH_MIN_ROWS rows,
    ``LLMD_FLASH_CHUNKS=0`` and bfloat16 chunks (their quality gate: kernels/cpu_attention.py) keep
    the gathered-scores path (still matching float64)."""
    calls = _spy(monkeypatch)
    dtype = torch.bfloat16 if why == "bfloat16" else torch.float32
    case = {"kind": "prefill", "group": 3, "block_size": 16, "head_dim": 64, "fmt": "int8" if why == "int8" else "auto",
            "window": 7 if why == "window" else None, "dtype": dtype}
    if why == "short":
        monkeypatch.setattr(cpu_attention, "FLASH_MIN_ROWS", 41)
    if why == "off":
        monkeypatch.setattr(cpu_attention, "_FLASH_CHUNKS", False)
    meta, query, cache = make_step(case, seed=5)
    q = query.to(dtype)
    out = ops.paged_attention(q, cache, meta, 0.125, case["window"])
    assert calls == []
    ref = reference.paged_attention(q.double(), cache, meta, 0.125, case["window"], compute_dtype=torch.float64)
    assert rel(out, ref) <= TOL[dtype]


def test_a_bfloat16_cascade_prefix_takes_the_flash_kernel(monkeypatch):
    """A bfloat16 step whose prefill chunks share cached blocks attends to the shared prefix once,
    through ``cpu_flash.prefix_attention`` (stacked queries, no mask), within the bfloat16 tolerance."""
    from test_cpu_cascade import shared_prefix_step

    calls = []
    real = cpu_attention._flash_prefix
    monkeypatch.setattr(cpu_attention, "_flash_prefix", lambda q, *a: calls.append(q.shape) or real(q, *a))
    meta, query, cache = shared_prefix_step(16, 3, "auto", torch.bfloat16, seed=7, prefill=True)
    q = query.bfloat16()
    out = ops.paged_attention(q, cache, meta, 0.125)
    assert calls, "the shared prefix did not take the flash kernel"
    ref = reference.paged_attention(q.double(), cache, meta, 0.125, None, compute_dtype=torch.float64)
    assert rel(out, ref) <= TOL[torch.bfloat16]
