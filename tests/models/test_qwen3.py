"""Qwen3: a tiny random ``qwen3`` GGUF loaded by llmd, run through the engine (batched prefill in
chunks, then decode), equals HF transformers' ``Qwen3ForCausalLM`` float32 built from the same
weights: max |Δlogit| < 1e-3 on the ``torch`` and ``cpu`` attention backends."""

import pytest
import torch
from tiny_engine import ByteTokenizer
from tiny_qwen3 import TINY, hf_qwen3, write_tiny_qwen3

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.request import SamplingParams
from llmd.models.gguf_loader import load_model
from llmd.models.qwen3 import Qwen3ForCausalLM

PROMPTS = ["Hello", "The quick brown fox jumps", "a" * 37, "Qwen3 normalises q and k per head before RoPE."]


@pytest.fixture(scope="module")
def qwen3_files(tmp_path_factory):
    """(gguf path, HF model) for the tiny Qwen3 with an untied LM head."""
    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"
    written = write_tiny_qwen3(path, tied=False)
    return str(path), hf_qwen3(written, tied=False)


def test_config_and_tensor_map(qwen3_files):
    """arch qwen3 -> Qwen3ForCausalLM; head_dim from key_length; q/k norms [head_dim] per layer."""
    model, cfg = load_model(qwen3_files[0], torch.float32)
    assert isinstance(model, Qwen3ForCausalLM) and cfg.architecture == "qwen3"
    assert (cfg.head_dim, cfg.num_heads, cfg.hidden_size, cfg.rope_theta) == (32, 4, 64, 1e6)
    assert not cfg.tie_word_embeddings
    attn = model.layers[1].self_attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (TINY["head_dim"],)
    assert "blk.1.attn_q_norm.weight" in model.gguf_tensor_map()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_engine_logits_match_hf(qwen3_files, backend):
    """Every sampled row (chunked prefill of 4 prompts together, then 4 decode steps) vs HF's
    logits of the same sequence's last position."""
    path, hf = qwen3_files
    model, _ = load_model(path, torch.float32)
    engine = Engine(model, ByteTokenizer(), EngineConfig(
        model=path, device="cpu", dtype="float32", attention_backend=backend, threads=torch.get_num_threads(),
        kv_cache_memory=2**20, max_num_batched_tokens=32, prefix_cache_seed=0))
    seen = []
    sampler = engine.runner.sampler

    def recording(logits, requests):
        seen.extend((list(r.token_ids), row.clone()) for r, row in zip(requests, logits))
        return sampler(logits, requests)

    engine.runner.sampler = recording
    engine.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0))
    assert len(seen) == 5 * len(PROMPTS)
    worst = 0.0
    with torch.inference_mode():
        for ids, ours in seen:
            ref = hf(input_ids=torch.tensor([ids])).logits[0, -1]
            worst = max(worst, float((ours - ref).abs().max()))
    assert worst < 1e-3, worst
