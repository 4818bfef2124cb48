"""The fused single-stream decode path (``kernels/cpu_fused.py``) end to end on tiny random GGUFs:
its packs hold the file's own weights (Q4_0, Q4_1, Q4_K, Q8_0; Q/K rows un-permuted like the dense
model's), they survive the weights cache, and the runner takes the path for batch-1 decode steps
only, says so on the startup line, and its logits track the torch path's step by step."""

import gguf
import pytest
import torch
from tiny_engine import ByteTokenizer
from tiny_gguf import write_tiny_llama

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.model_runner import ModelRunner
from llmd.daemon.core.request import SamplingParams
from llmd.kernels import cpu_fused
from llmd.models.gguf_loader import load_model
from llmd.quant import native_packs
from llmd.quant.packed_linear import PackedLinear

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_fused.available(64, 3), reason="fused kernel unavailable on this CPU")
SHAPE = dict(hidden=192, heads=3, kv_heads=1, ffn=384)  # SmolLM2's head_dim and group: the kernel build it uses


def _packed(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0])
def test_native_packs_hold_the_files_weights(tmp_path, qtype):
    shape = dict(hidden=256, heads=4, kv_heads=2, ffn=512) if qtype == T.Q4_K else SHAPE  # Q4_K: 256-wide blocks
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, qtype=qtype, **shape)
    dense, _ = load_model(path, torch.float32)
    model, _ = load_model(path, torch.bfloat16, weight_quant="gguf", native=True)
    params = dict(dense.named_parameters())
    packed = _packed(model)
    assert len(packed) == 4 * 2 + 1  # every projection of both layers, and the head
    for name, mod in packed.items():
        kind, pack = mod.native_pack()
        want = dense.embed_tokens.weight if name == "logits_proj" else params[f"{name}.weight"]
        got = native_packs.dequantize(kind, pack)
        # Q4_K's d · sc_j and dmin · m_j are rounded to float16 (relative 2^-11 each); the others are exact
        tol = 2**-9 * want.abs().max().item() if qtype == T.Q4_K else 0.0
        assert (got - want).abs().max().item() <= tol, name


def test_native_packs_through_the_weights_cache(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, qtype=T.Q4_1, **SHAPE)
    kw = dict(weight_quant="gguf", weights_cache=True, cache_dir=str(tmp_path / "cache"))
    first, _ = load_model(path, torch.bfloat16, native=True, **kw)
    again, _ = load_model(path, torch.bfloat16, native=True, **kw)
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 1  # the second load read the entry
    for (name, a), (_, b) in zip(_packed(first).items(), _packed(again).items()):
        (ka, pa), (kb, pb) = a.native_pack(), b.native_pack()
        assert ka == kb and all(torch.equal(x, y) for x, y in zip(pa, pb)), name
    plain, _ = load_model(path, torch.bfloat16, native=False, **kw)  # its own entry, without the copy
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 2
    assert all(m.native_pack() is None for m in _packed(plain).values())


def _engine(path, **kw):
    model, _ = load_model(path, torch.bfloat16, weight_quant="gguf", keep_dense=True, native=True)
    cfg = EngineConfig(model="tiny", device="cpu", dtype="bfloat16", attention_backend="cpu", weight_quant="gguf",
                       kv_cache_memory=4 * 2**20, threads=1, **kw)
    return Engine(model, ByteTokenizer(), cfg)


def test_batch1_decodes_run_fused_and_track_the_torch_path(tmp_path, monkeypatch):
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, qtype=T.Q4_1, vocab=256, **SHAPE)
    eng = _engine(path)
    assert "batch-1 steps: fused C kernel" in eng.runtime_summary()
    kernel = eng.runner.fused_decode
    calls, closeness = [], []

    def counting(*a):
        calls.append(a)
        return kernel(*a)

    orig = ModelRunner.compute_logits

    def both(self, out):  # every step: the torch path's logits first, then the step as configured
        self.fused_decode = None
        ref = orig(self, out).clone()
        self.fused_decode = counting
        n = len(calls)
        got = orig(self, out)
        if len(calls) > n:
            closeness.append((torch.nn.functional.cosine_similarity(got, ref).min().item(),
                              bool((got.argmax(-1) == ref.argmax(-1)).all())))
        return got

    monkeypatch.setattr(ModelRunner, "compute_logits", both)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng.add_request(list(b"hello fused decode"), greedy)
    while eng.has_unfinished_requests():
        eng.step()
    assert len(calls) == 11  # the 11 decode steps after the prefill's first token
    assert all(c > 0.999 for c, _ in closeness) and sum(a for _, a in closeness) >= 10, closeness
    before = len(calls)
    for text in (b"two streams", b"side by side"):
        eng.add_request(list(text), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert len(calls) == before  # batches of two decodes take the torch path


def test_disable_native_kernels_turns_the_fused_path_off(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, qtype=T.Q4_1, **SHAPE)
    eng = _engine(path, disable_native_kernels=True)
    assert eng.runner.fused_decode is None
    assert "batch-1 steps: torch ops, off (--disable-native-kernels" in eng.runtime_summary()


def test_two_kv_cache_groups_take_the_torch_path(tmp_path):
    """A model with a sliding-window group beside the full one (the step's metadata is one entry per
    group) runs its batch-1 decodes on torch ops, says why, and serves a single stream to the end
    (the runner once read the one-group metadata off the list and failed every such step)."""
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, qtype=T.Q4_1, sliding_window=8, sliding_layers=[True, False], **SHAPE)
    eng = _engine(path)
    assert eng.runner.fused_decode is None
    assert "batch-1 steps: torch ops, more than one KV cache group" in eng.runtime_summary()
    eng.add_request(list(b"a window and a full layer"), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [(o.finish_reason, o.num_output_tokens) for o in outs] == [("length", 20)]


def test_float32_by_auto_dtype_takes_the_fused_kernel(tmp_path, monkeypatch):
    """On a CPU without native bfloat16 (AVX2-only: float32 is the auto dtype) ``--weight-quant
    auto`` keeps the fused kernel's packs for batch-1 decode steps and the dense float32 weights for
    every other step (torch's int4 packs never run: small_batch 0); with the native kernels off it
    settles to ``none`` before any weights load. Engine.from_config's weight steps, on a tiny GGUF."""
    from llmd.daemon.core import config as config_module
    from llmd.models.header_cache import header_info

    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: False)
    path = str(tmp_path / "m.gguf")
    write_tiny_llama(path, qtype=T.Q4_1, vocab=256, **SHAPE)
    off = EngineConfig(model=path, device="cpu", disable_native_kernels=True).resolve()
    assert off.settle_weight_quant(header_info(path).config) is False and off.weight_quant == "none"
    cfg = EngineConfig(model=path, device="cpu", kv_cache_memory=4 * 2**20, threads=1).resolve()
    fused = cfg.settle_weight_quant(header_info(path).config)
    assert (fused, cfg.dtype, cfg.weight_quant, cfg.keep_dense) == (True, "float32", "gguf", True)
    model, _ = load_model(path, cfg.torch_dtype, "cpu", cfg.weight_quant, cfg.keep_dense, native=fused)
    assert {m.small_batch for m in _packed(model).values()} == {0}
    eng = Engine(model, ByteTokenizer(), cfg)
    assert "dtype float32" in eng.runtime_summary() and "batch-1 steps: fused C kernel" in eng.runtime_summary()
    calls = []
    kernel = eng.runner.fused_decode
    eng.runner.fused_decode = lambda *a: calls.append(1) or kernel(*a)
    eng.add_request(list(b"float32 and fused"), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert len(calls) == 8 and [o.num_output_tokens for o in outs] == [9]
