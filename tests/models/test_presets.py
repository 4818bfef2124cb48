"""Random-weight presets (``--model random:<preset>``): real shapes from the HF config.json files,
built without ``gguf``; weights seeded; a reduced-layer Qwen3-0.6B runs through the engine on CPU."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

from llmd.daemon.core.kv_size import kv_cache_bytes_per_token
from llmd.models.config import ModelConfig
from llmd.models.errors import LlmdError, ModelNotFoundError
from llmd.models.presets import NumericTokenizer, build_random_model, preset_config
from llmd.models.registry import model_class


def param_count(cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters, non-embedding parameters) of the model, counted on the meta device."""
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.embed_tokens.weight.numel()


@pytest.mark.parametrize("name, shape, kv_bytes, params", [
    # (layers, hidden, heads, kv_heads, head_dim, ffn, vocab, rope_theta, eps, tied), 16-bit B/token,
    # published size: Qwen3-0.6B "0.44B non-embedding", Llama-3-8B "8.03B"
    ("random:qwen3-0.6b", (28, 1024, 16, 8, 128, 3072, 151936, 1e6, 1e-6, True), 114_688, (0.44e9, 1)),
    ("random:llama-3-8b", (32, 4096, 32, 8, 128, 14336, 128256, 5e5, 1e-5, False), 131_072, (8.03e9, 0)),
])
def test_preset_shapes(name, shape, kv_bytes, params):
    cfg = preset_config(name)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == shape
    assert kv_cache_bytes_per_token(cfg, "auto", torch.bfloat16) == kv_bytes
    assert kv_cache_bytes_per_token(cfg, "int8", torch.bfloat16) == 2 * cfg.num_layers * 8 * (128 + 4)
    total, non_embedding = param_count(cfg)
    published, which = params
    assert abs((non_embedding if which else total) - published) < 0.005e9, (total, non_embedding)


def test_preset_names_and_layers_option():
    assert preset_config("random:qwen3-0.6b:layers=3").num_layers == 3
    with pytest.raises(ModelNotFoundError, match="random:llama-3-8b, random:qwen3-0.6b"):
        preset_config("random:qwen3-7b")
    for bad in ("random:qwen3-0.6b:layers=0", "random:qwen3-0.6b:layers=29", "random:qwen3-0.6b:depth=2"):
        with pytest.raises(LlmdError, match="layers=N"):
            preset_config(bad)


def test_random_weights_seeded_and_small():
    """Same seed → same weights; another seed → different; matrices N(0, 0.02²), norms 1."""
    cfg = dataclasses.replace(preset_config("random:qwen3-0.6b:layers=1"), vocab_size=512, hidden_size=128,
                              intermediate_size=256, num_heads=2, num_kv_heads=1)
    a, b, c = (build_random_model(cfg, torch.float32, "cpu", seed=s) for s in (0, 0, 1))
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["layers.0.self_attn.qkv_proj.weight"], pc["layers.0.self_attn.qkv_proj.weight"])
    w = pa["layers.0.mlp.gate_up_proj.weight"]
    assert abs(float(w.std()) - 0.02) < 2e-3 and float(w.mean().abs()) < 1e-3
    assert torch.equal(pa["layers.0.self_attn.q_norm.weight"], torch.ones(128))


def test_numeric_tokenizer():
    tok = NumericTokenizer(preset_config("random:qwen3-0.6b"))
    assert tok.encode("15 27 3") == [15, 27, 3] and tok.encode("hé") == [104, 195, 169]
    assert tok.decode([15, 151935]) == " 15 151935" and tok.encode(tok.decode([15, 151935])) == [15, 151935]
    with pytest.raises(LlmdError, match="no chat template"):
        tok.apply_chat([{"role": "user", "content": "hi"}])


def test_reduced_qwen3_preset_runs_without_gguf():
    """A 2-layer random:qwen3-0.6b (real layer shape and vocabulary, bfloat16) through the engine on
    CPU in a process where ``import gguf`` fails: greedy tokens in the vocabulary, finite logits."""
    code = textwrap.dedent("""
        import sys
        sys.modules["gguf"] = None  # any import of gguf now raises
        import torch
        from llmd.daemon.core.config import EngineConfig
        from llmd.daemon.core.engine import Engine
        from llmd.daemon.core.request import SamplingParams
        e = Engine.from_config(EngineConfig(model="random:qwen3-0.6b:layers=2", device="cpu", dtype="bfloat16",
                                            attention_backend="cpu", kv_cache_memory=8 * 2**20, threads=1,
                                            prefix_cache_seed=0))
        assert e.bytes_per_token == 2 * 2 * 8 * 128 * 2, e.bytes_per_token
        out = e.generate(["1 2 3 4 5 6 7", "hello world"], SamplingParams(max_tokens=3, temperature=0.0))
        logits = e.runner.prefill_logits("probe", [1, 2, 3], 0, [[1]])
        assert torch.isfinite(logits).all() and 0.1 < float(logits.std()) < 100, float(logits.std())
        assert all(len(o["token_ids"]) == 3 and all(0 <= t < 151936 for t in o["token_ids"]) for o in out)
        print("ok", out[0]["text"])
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]
