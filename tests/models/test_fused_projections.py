"""Fused Q/K/V and gate/up projections (issue 13) on tiny random GGUFs: the separate parameters
do not exist, each GGUF tensor lands in its rows, and the forward equals an unfused float64
computation from the GGUF tensors; the slot map must tile every parameter; RoPE and RMSNorm
fast forms equal the explicit HF formulas bit for bit."""

import gguf
import pytest
import torch
from gemma_fixtures import contiguous_meta
from tiny_gguf import write_tiny_llama
from torch.nn import functional as F

from llmd.models import llama
from llmd.models.errors import GGUFLoadError
from llmd.models.gguf_loader import load_model
from llmd.models.layers import GemmaRMSNorm, RMSNorm, apply_rope, rope_tables
from llmd.models.llama import unpermute_qk

SEPARATE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_ref(x, pos, theta):
    """HF rotate-half RoPE in float64; ``x [T, heads, D]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([pos[:, None].double() * inv] * 2, -1)[:, None]
    rot = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1)
    return x * ang.cos() + rot * ang.sin()


def unfused_reference(w: dict, cfg, ids: list[int]) -> torch.Tensor:
    """Causal forward over one sequence with separate q/k/v/gate/up matmuls, float64, from the
    GGUF tensors as written (Q/K un-permuted to HF's layout). Returns ``[T, hidden]``."""
    t = {k: torch.from_numpy(v).double() for k, v in w.items()}
    h, kvh, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    pos = torch.arange(len(ids))
    x = t["token_embd.weight"][ids]
    mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        g = {n.split(".")[2]: v for n, v in t.items() if n.startswith(f"blk.{i}.")}
        a = rms(x, g["attn_norm"], eps)
        q = (a @ torch.from_numpy(unpermute_qk(w[f"blk.{i}.attn_q.weight"], h)).double().T).view(-1, h, d)
        k = (a @ torch.from_numpy(unpermute_qk(w[f"blk.{i}.attn_k.weight"], kvh)).double().T).view(-1, kvh, d)
        v = (a @ g["attn_v"].T).view(-1, kvh, d)
        q, k = rope_ref(q, pos, cfg.rope_theta), rope_ref(k, pos, cfg.rope_theta)
        k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * cfg.softmax_scale
        o = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
        x = x + o.reshape(len(ids), h * d) @ g["attn_output"].T
        m = rms(x, g["ffn_norm"], eps)
        x = x + (F.silu(m @ g["ffn_gate"].T) * (m @ g["ffn_up"].T)) @ g["ffn_down"].T
    return rms(x, t["output_norm.weight"], eps)


def test_fused_parameters_replace_separate_ones(tmp_path):
    path = tmp_path / "m.gguf"
    written = write_tiny_llama(path, qtype=gguf.GGMLQuantizationType.F32)
    model, cfg = load_model(str(path))
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if set(n.split(".")) & set(SEPARATE)]
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert not any(hasattr(attn, s) for s in SEPARATE[:3]) and not any(hasattr(mlp, s) for s in SEPARATE[3:])
    q, kv, ffn = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    assert attn.qkv_proj.weight.shape == (q + 2 * kv, cfg.hidden_size)
    assert mlp.gate_up_proj.weight.shape == (2 * ffn, cfg.hidden_size)
    wq = torch.from_numpy(unpermute_qk(written["blk.1.attn_q.weight"], cfg.num_heads))
    wk = torch.from_numpy(unpermute_qk(written["blk.1.attn_k.weight"], cfg.num_kv_heads))
    wv, wg, wu = (torch.from_numpy(written[f"blk.1.{n}.weight"]) for n in ("attn_v", "ffn_gate", "ffn_up"))
    assert torch.equal(attn.qkv_proj.weight, torch.cat((wq, wk, wv)))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat((wg, wu)))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_fused_forward_equals_unfused_reference(tmp_path, heads, kv_heads):
    """Prefill 7 tokens, then decode 1 against the cache: both equal the unfused float64 forward."""
    path = tmp_path / "m.gguf"
    written = write_tiny_llama(path, heads=heads, kv_heads=kv_heads, qtype=gguf.GGMLQuantizationType.F32, seed=3)
    model, cfg = load_model(str(path))
    ids = [5, 17, 200, 3, 99, 42, 7, 128]
    caches = [torch.zeros(2, 4, 4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    with torch.inference_mode():
        pre = model(torch.tensor(ids[:7]), torch.arange(7), caches, contiguous_meta([(1, 0, 7)], 4))
        dec = model(torch.tensor(ids[7:]), torch.tensor([7]), caches, contiguous_meta([(1, 7, 1)], 4))
    ref = unfused_reference(written, cfg, ids).float()
    torch.testing.assert_close(torch.cat((pre, dec)), ref, rtol=1e-5, atol=1e-5)


def test_slot_map_must_tile_every_parameter(tmp_path, monkeypatch):
    """A map that forgets a part of a fused weight fails before loading, naming the parameter."""
    path = tmp_path / "m.gguf"
    write_tiny_llama(path)
    broken = {k: v for k, v in llama.LlamaForCausalLM.layer_tensors.items() if k != "attn_v"}
    monkeypatch.setattr(llama.LlamaForCausalLM, "layer_tensors", broken)
    with pytest.raises(GGUFLoadError, match=r"layers\.0\.self_attn\.qkv_proj\.weight rows"):
        load_model(str(path))


def test_missing_part_of_fused_weight_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, drop=("blk.0.attn_k.weight",))
    with pytest.raises(GGUFLoadError, match=r"lacks tensor blk\.0\.attn_k\.weight"):
        load_model(str(path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_norms_equal_explicit_formulas_bitwise(dtype):
    """The four-op RoPE on a strided Q|K view and F.rms_norm equal HF's explicit forms exactly."""
    torch.manual_seed(0)
    pos = torch.tensor([0, 1, 9, 511, 4000])
    qkv = torch.randn(5, 7 * 64, dtype=dtype) * 3
    qk = qkv[:, : 6 * 64].view(5, 6, 64)
    for theta in (1e4, 1e6):
        inv = 1.0 / (theta ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
        emb = torch.cat([pos.float()[:, None] * inv] * 2, -1)
        cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
        want = qk * cos + torch.cat((-qk[..., 32:], qk[..., :32]), -1) * sin
        assert torch.equal(apply_rope(qk, rope_tables(pos, 64, theta, dtype)), want)
    x, w = torch.randn(32, 576, dtype=dtype) * 2, torch.randn(576, dtype=dtype)
    for cls in (RMSNorm, GemmaRMSNorm):
        norm = cls(576, 1e-6, dtype)
        norm.weight.data.copy_(w)
        xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        want = w * xf.to(dtype) if cls is RMSNorm else (xf * w.float()).to(dtype)
        assert torch.equal(norm(x), want), cls.__name__
