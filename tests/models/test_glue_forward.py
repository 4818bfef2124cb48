"""models/glue_forward.py: the fused-glue Llama forward gives the generic forward's bits.

Two bfloat16 engines on the cpu backend share one tiny random Llama (with and without a sliding
window group); one runs the fused forward, the other the generic layers (``glue_forward.why_not``
patched to refuse). Every step's logits, the generated tokens and the KV caches must be equal bit
for bit over chunked prefills, mixed steps, batched decodes and prefix-cache hits.
"""

from __future__ import annotations

import pytest
import torch

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.request import SamplingParams
from llmd.kernels import cpu_glue
from llmd.kernels.native import build
from llmd.models import glue_forward
from llmd.models.gguf_loader import load_model
from llmd.quant import fp16_linear

pytestmark = pytest.mark.skipif(build.load_glue() is None, reason="no C compiler for the native glue")


def run(engine: Engine, prompts: list[list[int]], fused: bool, monkeypatch) -> tuple[list, list]:
    """Greedy generations of ``prompts`` (added two at a time, so prefills meet decodes); returns
    (each step's logits, each request's tokens)."""
    model = engine.runner.model
    if not fused:
        monkeypatch.setattr(glue_forward, "why_not", lambda *a: "generic, for comparison")
    model._glue_refs = []  # judge the caches again
    logits = []
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: logits.append(real(h)) or logits[-1])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for i, ids in pending[:2]:
            engine.add_request(ids, params, f"r{i}")
        pending = pending[2:]
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    monkeypatch.undo()
    return logits, [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("window,kv_dtype", [(None, "auto"), (24, "auto"), (None, "int8"), (24, "int8-none")])
def test_fused_forward_equals_generic_bit_for_bit(tmp_path, monkeypatch, window, kv_dtype):
    from tiny_engine import ByteTokenizer
    from tiny_gguf import write_tiny_llama

    path = tmp_path / "t.gguf"
    layers = 3
    write_tiny_llama(path, layers=layers, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, sliding_window=window,
                     sliding_layers=[i % 2 == 0 for i in range(layers)] if window else None)
    model, _ = load_model(str(path), torch.bfloat16, "cpu")
    kw = dict(model=str(path), device="cpu", dtype="bfloat16", attention_backend="cpu", kv_cache_memory=4 << 20,
              max_model_len=256, weight_quant="none", max_num_batched_tokens=48, prefix_cache_seed=0,
              kv_cache_dtype=kv_dtype.split("-")[0], kv_rotation=kv_dtype.split("-")[1] if "-" in kv_dtype else None)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 70, 17, 33, 1)]
    prompts += [shared + [7, 8], shared + [9]]  # a prefix-cache hit
    fused_engine = Engine(model, ByteTokenizer(), EngineConfig(**kw).resolve())
    assert glue_forward.why_not(model, fused_engine.runner.layer_caches) is None or not cpu_glue.active
    a_logits, a_tokens = run(fused_engine, prompts, True, monkeypatch)
    assert model._glue_ok  # the fused forward ran
    generic_engine = Engine(model, ByteTokenizer(), EngineConfig(**kw).resolve())
    b_logits, b_tokens = run(generic_engine, prompts, False, monkeypatch)
    assert not model._glue_ok
    assert a_tokens == b_tokens
    assert len(a_logits) == len(b_logits) and all(torch.equal(x, y) for x, y in zip(a_logits, b_logits))
    for ca, cb in zip(fused_engine.runner.caches, generic_engine.runner.caches):
        assert torch.equal(ca.data, cb.data)
        assert (ca.scales is None) == (kv_dtype == "auto") and (ca.scales is None or torch.equal(ca.scales, cb.scales))


def test_why_not_names_what_it_does_not_serve(tmp_path):
    from tiny_engine import ByteTokenizer
    from tiny_gguf import write_tiny_llama

    path = tmp_path / "t.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
    model, _ = load_model(str(path), torch.bfloat16, "cpu")
    kw = dict(model=str(path), device="cpu", dtype="bfloat16", attention_backend="cpu", kv_cache_memory=4 << 20,
              max_model_len=256, weight_quant="none")
    fp8 = Engine(model, ByteTokenizer(), EngineConfig(**kw, kv_cache_dtype="fp8_e4m3").resolve())
    grouped = Engine(model, ByteTokenizer(),
                     EngineConfig(**kw, kv_cache_dtype="int8", kv_scale_group_size=16).resolve())
    int8 = Engine(model, ByteTokenizer(), EngineConfig(**kw, kv_cache_dtype="int8").resolve())
    cpu_glue.active = True
    try:
        for other in (fp8, grouped):
            assert glue_forward.why_not(model, other.runner.layer_caches) == \
                "a quantized KV cache other than int8 with dynamic scales"
        assert glue_forward.why_not(model, int8.runner.layer_caches) is None
        f32, _ = load_model(str(path), torch.float32, "cpu")
        assert glue_forward.why_not(f32, int8.runner.layer_caches) == \
            "a float32 model's cache other than float32 or float16 without rotation"
    finally:
        cpu_glue.active = False
    assert glue_forward.why_not(model, int8.runner.layer_caches) == "the C layer glue is off"
    assert glue_forward.why_not(model, int8.runner.layer_caches, check_active=False) is None


def test_the_switch_turns_it_off_alone_and_the_startup_line_says_which(tmp_path, monkeypatch):
    """``LLMD_GLUE_FORWARD=0`` refuses the fused forward while the C passes stay on; the startup
    line says ``fused across ops`` only when the forward would run."""
    from tiny_engine import ByteTokenizer
    from tiny_gguf import write_tiny_llama

    path = tmp_path / "t.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
    model, _ = load_model(str(path), torch.bfloat16, "cpu")
    kw = dict(model=str(path), device="cpu", dtype="bfloat16", attention_backend="cpu", kv_cache_memory=4 << 20,
              max_model_len=256, weight_quant="none")
    engine = Engine(model, ByteTokenizer(), EngineConfig(**kw).resolve())
    assert "norms, RoPE, SwiGLU: C, fused across ops" in engine.runtime_summary()
    monkeypatch.setenv("LLMD_GLUE_FORWARD", "0")
    assert glue_forward.why_not(model, engine.runner.layer_caches, check_active=False) == "LLMD_GLUE_FORWARD=0"
    summary = engine.runtime_summary()
    assert "norms, RoPE, SwiGLU: C" in summary and "fused across ops" not in summary


def test_a_projection_in_another_layout_is_refused():
    """The passes read raw pointers: an output that is not contiguous bfloat16 of the expected
    width raises instead of being read wrongly."""
    ok = torch.zeros(3, 8, dtype=torch.bfloat16)
    assert glue_forward._rows_of(ok, 3, 8, torch.bfloat16) is ok
    for bad in (ok.float(), ok[:, :4], ok.t().contiguous().t(), torch.zeros(3, 9, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="not contiguous torch.bfloat16"):
            glue_forward._rows_of(bad, 3, 8, torch.bfloat16)


@pytest.mark.skipif(not fp16_linear.available(), reason="torch without fbgemm's fp16 GEMM here")
@pytest.mark.parametrize("window,kv_dtype", [(None, "float16"), (24, "auto")])
def test_float32_forward_beside_the_fp16_packs(tmp_path, monkeypatch, window, kv_dtype):
    """A float32 model with the fp16 packs (``--dtype auto`` on a CPU without native bfloat16) runs
    the fused forward on layer_glue_f32.h: every step's logits within float32 rounding of the
    generic torch layers' (same packs, same attention), the same tokens, the caches as close; an
    explicit float32 engine (no packs: exact float32) keeps the generic layers."""
    from tiny_engine import ByteTokenizer
    from tiny_gguf import write_tiny_llama

    path = tmp_path / "t.gguf"
    write_tiny_llama(path, layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, sliding_window=window,
                     sliding_layers=[i % 2 == 0 for i in range(3)] if window else None)
    model, _ = load_model(str(path), torch.float32, "cpu")
    kw = dict(model=str(path), device="cpu", dtype="float32", attention_backend="cpu", kv_cache_memory=4 << 20,
              max_model_len=256, weight_quant="none", max_num_batched_tokens=48, prefix_cache_seed=0,
              kv_cache_dtype=kv_dtype)

    def engine(packs: bool) -> Engine:
        cfg = EngineConfig(**kw).resolve()
        cfg.fp16_weights = packs  # what --dtype auto sets on a CPU without native bf16
        return Engine(model, ByteTokenizer(), cfg)

    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 70, 17, 1)]
    prompts += [shared + [7, 8], shared + [9]]  # a prefix-cache hit
    fused = engine(True)
    assert fused.runner.native_glue and "SwiGLU: C, fused across ops" in fused.runtime_summary()
    a_logits, a_tokens = run(fused, prompts, True, monkeypatch)
    assert model._glue_ok
    generic = engine(True)
    b_logits, b_tokens = run(generic, prompts, False, monkeypatch)
    assert not model._glue_ok
    assert a_tokens == b_tokens and len(a_logits) == len(b_logits)
    assert any(not torch.equal(x, y) for x, y in zip(a_logits, b_logits))  # the C passes round differently
    for x, y in zip(a_logits, b_logits):
        assert (x - y).abs().max() <= 1e-4 * y.abs().max(), (x - y).abs().max()
    for ca, cb in zip(fused.runner.caches, generic.runner.caches):
        assert ca.data.dtype == (torch.float16 if kv_dtype == "float16" else torch.float32)
        torch.testing.assert_close(ca.data.float(), cb.data.float(), rtol=2e-3, atol=1e-4)
    plain = engine(False)
    assert not plain.runner.native_glue and "SwiGLU: C" not in plain.runtime_summary()


def test_the_startup_line_names_only_the_ops_the_glue_runs():
    """Gemma's float32 norm and GeLU-tanh MLP keep torch's ops, so its startup line names RoPE
    alone; a Llama-style model (RMSNorm, SiLU-gated MLP) names all three."""
    from llmd.daemon.core.engine import glue_ops
    from llmd.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm

    llama = torch.nn.ModuleList([RMSNorm(8, 1e-6, torch.float32), GatedMLP(8, 16, torch.float32, "silu")])
    gemma = torch.nn.ModuleList([GemmaRMSNorm(8, 1e-6, torch.float32), GatedMLP(8, 16, torch.float32, "gelu_tanh")])
    assert glue_ops(llama) == "norms, RoPE, SwiGLU"
    assert glue_ops(gemma) == "RoPE"
