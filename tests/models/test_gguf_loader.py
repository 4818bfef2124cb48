"""GGUF loading on tiny random files: every tensor mapped, every parameter filled, exact dequantization."""

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import write_tiny_llama

from llmd.models.errors import GGUFLoadError, ModelNotFoundError
from llmd.models.gguf_loader import load_config, load_model
from llmd.models.llama import unpermute_qk
from llmd.models.registry import resolve_model

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K,
                                   Q.Q6_K])
def test_dequantization_matches_gguf_quants(tmp_path, qtype):
    # K-quants need rows that are multiples of 256 elements
    hidden = 256
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, hidden=hidden, heads=4, kv_heads=2, ffn=256, qtype=qtype)
    model, cfg = load_model(str(path))
    params = dict(model.named_parameters())
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        if t.name.endswith("attn_q.weight"):
            ref = unpermute_qk(ref, cfg.num_heads)
        if t.name.endswith("attn_k.weight"):
            ref = unpermute_qk(ref, cfg.num_kv_heads)
        assert torch.equal(model.gguf_tensor_map()[t.name].of(params), torch.from_numpy(np.array(ref))), t.name


def test_tied_embeddings_have_no_lm_head(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, tied=True)
    model, cfg = load_model(str(path))
    assert cfg.tie_word_embeddings and model.lm_head is None
    h = torch.randn(3, cfg.hidden_size)
    assert torch.equal(model.compute_logits(h), h @ model.embed_tokens.weight.t())
    assert not any(torch.isnan(p).any() for p in model.parameters())


def test_untied_output_weight_is_loaded(tmp_path):
    path = tmp_path / "m.gguf"
    written = write_tiny_llama(path, tied=False, qtype=Q.F32)
    model, cfg = load_model(str(path))
    assert not cfg.tie_word_embeddings
    assert torch.equal(model.lm_head.data, torch.from_numpy(written["output.weight"]))


def test_missing_tensor_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(GGUFLoadError, match=r"blk\.1\.ffn_up\.weight"):
        load_model(str(path))


def test_unmapped_tensor_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, extra=("blk.0.mystery.weight",))
    with pytest.raises(GGUFLoadError, match=r"blk\.0\.mystery\.weight"):
        load_model(str(path))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, arch="mamba")
    assert load_config(str(path)).architecture == "mamba"
    with pytest.raises(GGUFLoadError, match="unsupported model architecture 'mamba'"):
        load_model(str(path))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFLoadError, match="not a readable GGUF"):
        load_model(str(path))


def test_resolve_model_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'nope'"):
        resolve_model("nope")
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "missing.gguf"))
