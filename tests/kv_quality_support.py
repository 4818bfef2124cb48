"""Shared pieces of the SmolLM2 and Gemma 3 halves of cases Q1/Q4 (test_kv_quality*.py)."""

from __future__ import annotations

import pytest
import torch

from llmd.daemon.bench.kv_quality import KV_DTYPES, quality_row


def xfail_for(reason: str, *names: str) -> list:
    """The quantized KV dtypes as parameters, the ``names`` among them strict xfails for ``reason``."""
    mark = pytest.mark.xfail(strict=True, reason=reason)
    return [pytest.param(n, marks=mark) if n in names else n for n in KV_DTYPES[1:]]


@pytest.fixture(scope="module")
def one_torch_thread():
    """These tests are matmul-bound; one intra-op thread keeps them fast on shared/oversubscribed
    CPUs (4× faster than 2 threads under contention here, ≤ 2× slower on an idle 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TOP1_MIN = {"int8": 0.97, "fp8_e4m3": 0.94, "fp8_e5m2": 0.90}  # case Q1: teacher-forced top-1 agreement
DNLL_MAX_PCT = {"int8": 0.2, "fp8_e4m3": 0.75, "fp8_e5m2": 3.0}  # case Q4: ΔNLL budget (%)


# The Q1/Q4 bounds and xfails were measured on the torch reference (the oracle); the fast "cpu"
# backend (the CPU default) rounds quantized reads in another order and has its own figures.
QUALITY_BACKEND = "torch"


def engine_kw(dtype: str = "float32") -> dict:
    """EngineConfig fields of the teacher-forced runs (float64's 92,160 B/token needs more than
    float32's 64 MiB pool); ``threads``: the test's current torch setting (``one_torch_thread``)."""
    return {"device": "cpu", "dtype": dtype, "kv_cache_memory": (128 if dtype == "float64" else 64) * 2**20,
            "threads": torch.get_num_threads()}


def quality_getter(model, tokenizer, ids: list[int], dtype: str = "float32"):
    """``get(name)``: llmd's teacher-forced :class:`QualityRow` for one KV dtype, run on first use
    (each test pays for its own dtype; ``auto`` is the base of the others). ``dtype``: the
    model's (``--dtype``)."""
    rows = {}

    def get(name):
        if name not in rows:
            base = None if name == "auto" else get("auto")
            rows[name] = quality_row(model, tokenizer, ids, name, base, attention_backend=QUALITY_BACKEND,
                                     **engine_kw(dtype))
        return rows[name]

    return get
