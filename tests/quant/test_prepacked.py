"""Prepacked bfloat16 linears (quant/prepacked.py): oneDNN's packs give the same bits as
``F.linear``, in the layers, in ``PackedLinear``'s dense path and through an engine built on a
loaded model. Where an engine has installed a tile-order kernel (kernels/amx_linear.py on AMX,
kernels/dp_linear.py on AVX512-BF16) the packs are in tile order; the model-level checks below hold
for either (the kernels' own bounds: tests/kernels/test_tile_linears.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_engine import tiny_engine

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.kv_transfer import weights_digest
from llmd.daemon.core.request import SamplingParams
from llmd.models.gguf_loader import load_model
from llmd.quant import prepacked
from llmd.quant.packed_linear import PackedLinear, pack_int8

pytestmark = pytest.mark.skipif(not prepacked.cpu_supported(),
                                reason="torch built without oneDNN, or this CPU cannot pack bfloat16 (AVX2 only)")


@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (40, 24)])
def test_prepacked_equals_f_linear_bit_for_bit(out_f, in_f):
    g = torch.Generator().manual_seed(out_f + in_f)
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    p = torch.ops.mkldnn._reorder_linear_weight(w, prepacked.BATCH_HINT)
    assert p.is_mkldnn and torch.equal(p.to_dense(), w)
    for m in (1, 3, 5, 32, 65, 600):
        x = torch.randn(m, in_f, generator=g).bfloat16()
        assert torch.equal(prepacked.linear(x, p), F.linear(x, w)), m
    wide = torch.randn(7, 2 * in_f, generator=g).bfloat16()[:, ::2]  # a strided view
    assert torch.equal(prepacked.linear(wide, p), F.linear(wide, w))
    x3 = torch.randn(2, 3, in_f, generator=g).bfloat16()
    assert torch.equal(prepacked.linear(x3, p), F.linear(x3, w))
    assert prepacked.linear(x3, w).shape == (2, 3, out_f)  # plain weights: F.linear


def test_packed_linear_dense_path_prepacked():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g).bfloat16()
    codes = torch.randint(-127, 128, (64, 96), generator=g, dtype=torch.int8)
    layer = PackedLinear(96, 64, int8=pack_int8(codes, torch.rand(64, generator=g), torch.bfloat16), dense=w.clone(),
                         small_batch=4)
    layer.dense = torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w, 64), requires_grad=False)
    x = torch.randn(9, 96, generator=g).bfloat16()
    assert torch.equal(layer(x), F.linear(x, w))  # 9 rows > small_batch: the (packed) dense weight
    assert layer(x[:2]).shape == (2, 64)  # the int8 pack, untouched


def _greedy(engine, prompts, n=6):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [r["token_ids"] for r in engine.generate(prompts, params)]


def test_engine_prepacks_bf16_model_same_tokens(tmp_path, monkeypatch):
    """A bfloat16 engine on the CPU packs every layer weight of the loaded model once (a second
    engine on it finds them packed); its greedy tokens and logits equal those of the plain
    weights; the weights' digest (disaggregation's handshake) does not change; float32 is left
    alone; ``LLMD_ONEDNN_PREPACK=0`` turns it off."""
    base = tiny_engine(tmp_path / "t.gguf")  # writes the GGUF; float32: nothing packed
    assert base.runner.prepacked_linears == 0
    model, _ = load_model(str(tmp_path / "t.gguf"), torch.bfloat16, "cpu")
    kw = dict(model=str(tmp_path / "t.gguf"), device="cpu", dtype="bfloat16", attention_backend="cpu",
              kv_cache_memory=4 << 20, max_model_len=256, weight_quant="none")
    digest = weights_digest(model)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 50)), [7] * 19]
    monkeypatch.setenv("LLMD_ONEDNN_PREPACK", "0")
    plain = Engine(model, base.tokenizer, EngineConfig(**kw).resolve())
    assert plain.runner.prepacked_linears == 0
    want = _greedy(plain, prompts)
    hidden = torch.randn(3, model.config.hidden_size).bfloat16()
    layer0 = model.layers[0]
    want_mlp = layer0.mlp(hidden)
    monkeypatch.delenv("LLMD_ONEDNN_PREPACK")
    packed = Engine(model, base.tokenizer, EngineConfig(**kw).resolve())
    n = 4 * model.config.num_layers + 1  # qkv, o, gate_up, down; and the tied head's copy
    assert packed.runner.prepacked_linears == n
    assert prepacked.packed(layer0.mlp.down_proj.weight) and not prepacked.packed(model.embed_tokens.weight)
    assert torch.equal(layer0.mlp(hidden), want_mlp)
    assert _greedy(packed, prompts) == want
    again = Engine(model, base.tokenizer, EngineConfig(**kw).resolve())
    assert again.runner.prepacked_linears == 0  # already packed
    # kernels/amx_linear.py or kernels/dp_linear.py where the CPU has them (weight_quant none: the
    # VDPBF16PS kernel is wanted, dp_linear.wanted)
    from llmd.kernels import amx_linear, dp_linear

    if not amx_linear.available() and dp_linear.available():
        assert prepacked.tile_kernel == "VDPBF16PS" and prepacked.amx_count(model) == n
    kind = f"for {prepacked.tile_kernel}" if prepacked.amx_count(model) == n else "for oneDNN"
    assert f"linears: {n} bf16 weights prepacked {kind} (the tied LM head's as a copy" in again.runtime_summary()
    from llmd.kernels.native import build

    assert ("norms, RoPE, SwiGLU: C" in again.runtime_summary()) == (build.load_glue() is not None)
    assert weights_digest(model) == digest
    assert prepacked.unpack_model(model) == n
    assert not prepacked.packed(layer0.mlp.down_proj.weight) and torch.equal(layer0.mlp(hidden), want_mlp)


def test_plain_nn_linear_left_unpacked():
    """Only layers whose forward calls :func:`prepacked.linear` are packed: a plain ``nn.Linear``
    (whose forward is ``F.linear``) keeps its plain weight and still runs."""
    from llmd.models.layers import linear

    layer = torch.nn.Module()
    layer.ours = linear(16, 8, torch.bfloat16)
    layer.plain = torch.nn.Linear(16, 8, bias=False, dtype=torch.bfloat16)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    assert prepacked.prepack_model(model) == 1
    assert layer.ours.weight.is_mkldnn and not layer.plain.weight.is_mkldnn
    x = torch.randn(3, 16).bfloat16()
    assert layer.plain(x).shape == layer.ours(x).shape == (3, 8)


@pytest.mark.parametrize("cap", [prepacked.HEAD_COPY_MAX_BYTES, 0])
def test_tied_lm_head_packed_as_a_copy_under_the_cap(tmp_path, monkeypatch, cap):
    """Under ``--weight-quant gguf`` the LM head's dense weight (what batches of more than
    ``small_batch`` rows multiply by) is the embedding's table; an engine packs a copy of it while
    the copy stays under the cap (the table itself stays plain for the lookup) and says so on the
    startup line; the logits of a batch are bit-identical to the plain head's and the weights'
    digest is unchanged. Over the cap
    (here 0) the head stays shared and plain."""
    base = tiny_engine(tmp_path / "t.gguf")
    model, _ = load_model(str(tmp_path / "t.gguf"), torch.bfloat16, "cpu", weight_quant="gguf", keep_dense=True)
    head = model.logits_proj
    assert head.dense.data_ptr() == model.embed_tokens.weight.data_ptr()  # tied: one table
    hidden = torch.randn(head.small_batch + 5, model.config.hidden_size).bfloat16()
    want, digest = model.compute_logits(hidden), weights_digest(model)
    monkeypatch.setattr(prepacked, "HEAD_COPY_MAX_BYTES", cap)
    engine = Engine(model, base.tokenizer, EngineConfig(model=str(tmp_path / "t.gguf"), device="cpu", dtype="bfloat16",
                                                      attention_backend="cpu", kv_cache_memory=4 << 20,
                                                      weight_quant="gguf").resolve())
    line = engine.runtime_summary()
    assert not prepacked.packed(model.embed_tokens.weight)
    assert prepacked.packed(head.dense) == bool(cap)
    assert ("the tied LM head's as a copy" in line) == bool(cap), line
    assert torch.equal(model.compute_logits(hidden), want)
    assert weights_digest(model) == digest  # disaggregation's handshake sees the same weights
    prepacked.unpack_model(model)
    assert prepacked.head_copy_bytes(model) == 0 and torch.equal(model.compute_logits(hidden), want)


def test_tied_head_without_weight_quant_gets_a_packed_copy(tmp_path):
    """``--weight-quant none`` with a tied head: :func:`prepack_model` adds a
    :class:`TiedHeadCopy` (counted, its bytes reported) whose logits equal ``hidden @ table.T``
    bit for bit at batch and single-row sizes; the state dict and the weights' digest do not
    change; :func:`unpack_model` removes it. Over the cap, or with a head of its own, none is made."""

    tiny_engine(tmp_path / "t.gguf")
    model, _ = load_model(str(tmp_path / "t.gguf"), torch.bfloat16, "cpu")
    assert model.logits_proj is None and model.lm_head is None
    table = model.embed_tokens.weight
    keys, digest = set(model.state_dict()), weights_digest(model)
    hidden = torch.randn(33, model.config.hidden_size).bfloat16()
    want = [(h @ table.t()).float() for h in (hidden, hidden[:1])]
    n = prepacked.prepack_model(model)
    assert isinstance(model.logits_proj, prepacked.TiedHeadCopy) and prepacked.packed(model.logits_proj.dense)
    assert prepacked.head_copy_bytes(model) == table.nbytes and prepacked.packed_count(model) == n
    assert not prepacked.packed(table)
    assert all(torch.equal(model.compute_logits(h), w) for h, w in zip((hidden, hidden[:1]), want))
    assert set(model.state_dict()) == keys and weights_digest(model) == digest
    assert prepacked.prepack_model(model) == 0  # idempotent
    prepacked.unpack_model(model)
    assert model.logits_proj is None and prepacked.head_copy_bytes(model) == 0
    assert torch.equal(model.compute_logits(hidden), want[0])


def test_no_tied_head_copy_over_the_cap(tmp_path, monkeypatch):
    tiny_engine(tmp_path / "t.gguf")
    model, _ = load_model(str(tmp_path / "t.gguf"), torch.bfloat16, "cpu")
    monkeypatch.setattr(prepacked, "HEAD_COPY_MAX_BYTES", 0)
    prepacked.prepack_model(model)
    assert model.logits_proj is None
