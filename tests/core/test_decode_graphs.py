"""CUDA-graph decode (``llmd.daemon.core.cuda_graphs``) without a GPU: the padded static inputs a
capture reads, run eagerly on CPU, give the real rows exactly the unpadded step's logits
(float32) and write no KV for the padded rows; the bucket sizes; the per-device defaults of
``--max-num-seqs`` and the ``--gpu-memory-utilization`` budget.

Exactness needs the linears to be row-invariant across the two batch shapes: on this CPU
(oneDNN/MKL sgemm) float32 rows are bit-identical between M = n and M = bucket for n a multiple
of 4 (1 or 2 threads; below 4 rows another kernel path rounds differently), so the steps here
decode 12 and 20 sequences (buckets 16 and 32). Capture itself needs CUDA (not run here)."""

import dataclasses

import pytest
import torch

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.cuda_graphs import bucket_for, graph_batch_sizes
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.gpu_memory import activation_bytes, cuda_kv_cache_bytes
from llmd.daemon.core.request import SamplingParams
from llmd.models.config import ModelConfig
from llmd.models.presets import PRESETS, NumericTokenizer, build_random_model

TINY = ModelConfig(architecture="qwen3", name="tiny qwen3", num_layers=2, hidden_size=64, intermediate_size=128,
                   num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, rope_theta=1e4, rms_norm_eps=1e-6,
                   max_position=256, tie_word_embeddings=True)


def tiny_engine(backend: str, windows: tuple = ()) -> Engine:
    """A 2-layer random Qwen3-shaped engine in float32 (``windows``: per-layer sliding windows)."""
    cfg = dataclasses.replace(TINY, sliding_window=windows) if windows else TINY
    model = build_random_model(cfg, torch.float32, "cpu", std=0.2)
    return Engine(model, NumericTokenizer(cfg), EngineConfig(
        model="random:tiny", device="cpu", dtype="float32", attention_backend=backend, kv_cache_memory=2**21,
        max_num_seqs=32, max_num_batched_tokens=2048, prefix_cache_seed=0, threads=torch.get_num_threads()))


def engine_at_decode(backend: str, n: int, windows: tuple = ()):
    """An engine whose next step decodes ``n`` sequences (contexts 31..42: one CPU length bucket)."""
    engine = tiny_engine(backend, windows)
    for i in range(n):
        engine.add_request([(7 * i + j) % 256 for j in range(30 + i % 12)],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()  # every prompt prefilled in one step (budget 2048), one token sampled each
    out = engine.scheduler.schedule()
    assert len(out.scheduled) == n and all(len(s.token_ids) == 1 for s in out.scheduled)
    return engine, out


@pytest.mark.parametrize("backend, n, windows", [("torch", 12, ()), ("cpu", 12, ()), ("cpu", 20, ()),
                                                  ("torch", 20, (None, 24)), ("cpu", 12, (24, None))])
def test_padded_decode_equals_the_unpadded_step(backend, n, windows):
    engine, out = engine_at_decode(backend, n, windows)
    runner = engine.runner
    unpadded = runner.compute_logits(out)  # eager, n rows; stores this step's K/V
    stored = [c.data.clone() for c in runner.caches]
    assert runner.enable_decode_graphs(capture=False) == 0  # no CUDA: the padded path runs eagerly
    padded = runner.compute_logits(out)
    assert torch.equal(padded, unpadded)
    for c, before in zip(runner.caches, stored):  # real rows rewrote the same bytes; padded rows nothing
        assert torch.equal(c.data, before)
    bucket = bucket_for(n, runner.decode_graphs.sizes)
    st = runner.decode_graphs.static
    assert bucket > n and len(st.slots) == len(runner.groups)
    for g in range(len(st.slots)):
        assert st.slots[g][n:bucket].eq(-1).all() and not st.slots[g][:n].lt(0).any()
    assert st.seq_lens[n:bucket].eq(0).all() and st.seq_lens[:n].gt(30).all()


def test_padded_generation_matches_eager_tokens():
    """Whole greedy runs: graphs' padded path (CPU, eager) vs plain steps, same tokens."""
    results = []
    for padded in (False, True):
        engine = tiny_engine("cpu")
        if padded:
            engine.runner.enable_decode_graphs(capture=False)
        prompts = [[(5 * i + j) % 256 for j in range(10 + 3 * i)] for i in range(9)]
        results.append([r["token_ids"] for r in engine.generate(prompts, SamplingParams(
            max_tokens=6, temperature=0.0, ignore_eos=True))])
    assert results[0] == results[1]


def test_graph_batch_sizes_and_buckets():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]
    sizes = graph_batch_sizes(40)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 17, 33, 40, 41)] == [1, 4, 8, 16, 32, 40, 40, None]
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_max_num_seqs_resolves_per_device(monkeypatch):
    assert EngineConfig(device="cpu").resolve().max_num_seqs == 64
    assert EngineConfig(device="cpu", max_num_seqs=8).resolve().max_num_seqs == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig(device="cuda").resolve().max_num_seqs == 256
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(LlmdError, match="gpu-memory-utilization"):
            EngineConfig(device="cuda", gpu_memory_utilization=bad).resolve()


def test_gpu_memory_utilization_budget():
    gib = 2**30
    # 140 GiB device, 2 GiB in use (weights + context), 0.9: 126 - 2 - activations
    assert cuda_kv_cache_bytes(0.9, 140 * gib, 138 * gib, gib) == int(0.9 * 140 * gib) - 3 * gib
    with pytest.raises(LlmdError, match="leaves no KV cache"):
        cuda_kv_cache_bytes(0.5, 80 * gib, 30 * gib, gib)  # 50 GiB already used by others
    qwen = PRESETS["qwen3-0.6b"]
    act = activation_bytes(qwen, 4096, 256, 2)
    assert act > activation_bytes(qwen, 4096, 256, 2, cuda_graphs=False) > activation_bytes(qwen, 512, 64, 2)
    assert 0.5 * gib < act < 4 * gib  # logits of 256 x 151,936 float32 x 3 alone are 445 MiB
