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
    (torch.float32, None, 1, MIXED), (torch.float16, 24, 3, MIXED), (torch.float32, 40, 1, WHOLE)],
    ids=["mixed-f32", "mixed-window-splits-f16", "whole-window-f32"])
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



def _tiny_int4_engine(backend: str):
    """A 2-layer random Qwen3-shaped float32 engine (head_dim 16, GQA 2) with an int4 KV cache."""
    import dataclasses

    from llmd.daemon.core.config import EngineConfig
    from llmd.daemon.core.engine import Engine
    from llmd.models.config import ModelConfig
    from llmd.models.presets import NumericTokenizer, build_random_model

    cfg = ModelConfig(architecture="qwen3", name="tiny qwen3", num_layers=2, hidden_size=64, intermediate_size=128,
                      num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, rope_theta=1e4, rms_norm_eps=1e-6,
                      max_position=256, tie_word_embeddings=True)
    cfg = dataclasses.replace(cfg, sliding_window=(12, None))  # a local layer and a global one
    model = build_random_model(cfg, torch.float32, "cpu", std=0.2)
    return Engine(model, NumericTokenizer(cfg), EngineConfig(
        model="random:tiny", device="cpu", dtype="float32", attention_backend=backend, kv_cache_dtype="int4",
        kv_cache_memory=2**20, max_num_seqs=4, max_num_batched_tokens=24, prefix_cache_seed=0))


def test_engine_int4_triton_backend_matches_torch_backend():
    """The whole engine with ``--attention-backend triton --kv-cache-dtype int4`` (no longer
    refused): 3 prompts of 5-36 tokens, chunked prefill (24-token budget) mixed with decodes,
    5 greedy tokens each: the tokens of the torch backend and logprobs within 1e-3. CUDA graphs
    are refused for int4 in one line (decode steps run eagerly)."""
    from llmd.daemon.core.errors import LlmdError
    from llmd.daemon.core.request import SamplingParams

    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate((5, 23, 36))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    for backend in ("torch", "triton"):
        engine = _tiny_int4_engine(backend)
        ids = [engine.add_request(p, params) for p in prompts]
        lps = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for o in engine.step():
                lps[o.request_id] += o.logprobs
        runs[backend] = [lps[i] for i in ids]
    with pytest.raises(LlmdError, match="int4 KV cache run eagerly"):
        engine.runner.enable_decode_graphs(capture=False)
    for t, r in zip(runs["triton"], runs["torch"]):
        assert [lp.token_id for lp in t] == [lp.token_id for lp in r] and len(t) == 5
        assert max(abs(a.logprob - b.logprob) for a, b in zip(t, r)) < 1e-3


def test_gpu_check_int4_cases_under_the_interpreter():
    """The GPU script's int4 check cases (``python -m llmd.kernels.bench check``,
    kernels/kivi_check.py) run here on two of its rows: a split decode (float16) and a prefill
    (float32), within the check's budget, stored bytes equal to the CPU store's."""
    from llmd.kernels.bench import CHECK_BUDGET, _check_case, check_cases

    cases = [c for c in check_cases() if c["kv"] == "int4" and c["dtype"] != "bfloat16" and c["head_dim"] < 256
             and c["path"] != "decode"]  # the direct decode runs in the tests above
    assert {c["path"] for c in cases} == {"split", "prefill"}
    g = torch.Generator().manual_seed(0)
    for case in cases:
        err, exact = _check_case(case, g, "cpu")
        assert exact and err <= CHECK_BUDGET[case["dtype"]], (case, err, exact)
