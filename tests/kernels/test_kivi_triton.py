"""int4 (KIVI) KV cache through ``--attention-backend triton`` (issue 19): the torch store of
``kernels/kivi.py`` and the int4 decode / prefill kernels (``kivi_decode.py``, ``kivi_prefill.py``)
against the float64 oracle of the read rule (tests/fixtures/kivi_steps.py) and against the cpu
fast path on the same steps (same stored bytes, same outputs).

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set before the Triton modules are
imported); float32 and float16 models only: the interpreter's bfloat16 ``tl.dot`` is wrong
(test_kernels.py), bfloat16 is the GPU script's (``python -m llmd.kernels.bench check``).
Few steps, small shapes: the interpreter runs every program in Python."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kivi_steps import make_seqs, oracle, run_steps  # noqa: E402

from llmd.kernels import kivi_decode  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the Triton interpreter")

LENGTHS = [1, 16, 37, 70]  # a context of 1, one full block, non-multiples of the block size
#: (sequence, new tokens) per step: mixed prefill chunks and decodes crossing block boundaries
#: (a chunk that starts inside an open block, one that fills a block exactly, one spanning full
#: blocks), a decode-only step with a context of 1, and one that fills a block.
MIXED = [[(1, 9), (2, 20), (3, 35)], [(1, 7), (2, 1), (3, 20)], [(0, 1), (2, 1), (3, 1)], [(2, 14), (3, 14)],
         [(2, 1)]]
WHOLE = [[(0, 1), (1, 16), (2, 37), (3, 70)]]  # every prompt in one chunk: tails over several full blocks
#: ‖triton − float64 oracle‖ / ‖oracle‖ per model dtype (the GPU check's budgets, kernels/bench.py)
TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype,window,splits,steps", [
    (torch.float32, None, 1, MIXED), (torch.float16, 24, 3, MIXED), (torch.float32, None, 1, WHOLE),
    (torch.float16, 40, 1, WHOLE)], ids=["mixed-f32", "mixed-window-splits-f16", "whole-f32", "whole-window-f16"])
def test_triton_int4_matches_oracle_and_cpu_path(dtype, window, splits, steps, monkeypatch):
    """Outputs of every position within TOL of the float64 read-rule oracle and of the cpu fast
    path on the same steps; codes, scales, zero points and residual equal the cpu run's byte for
    byte. ``splits`` > 1 forces the split-KV decode (with the merge kernel)."""
    monkeypatch.setattr(kivi_decode, "num_decode_splits", lambda *a, **k: splits)
    lengths = LENGTHS if steps is MIXED else [n for _, n in steps[0]]
    seqs = make_seqs(lengths, 32, dtype, seed=11)
    outs, cache, _ = run_steps(seqs, steps, "triton", dtype, window)
    cpu_outs, cpu_cache, _ = run_steps(seqs, steps, "cpu", dtype, window)
    for i, (got, want, cpu) in enumerate(zip(outs, oracle(seqs, window, model_dtype=dtype), cpu_outs)):
        assert torch.isfinite(got).all()
        assert _rel(got, want) <= TOL[dtype], (i, _rel(got, want))
        assert _rel(got, cpu) <= TOL[dtype], (i, _rel(got, cpu))
    assert torch.equal(cache.data, cpu_cache.data) and torch.equal(cache.scales, cpu_cache.scales)
    assert torch.equal(cache.residual, cpu_cache.residual)

