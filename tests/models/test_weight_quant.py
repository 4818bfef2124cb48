"""``--weight-quant``: every projection of a GGUF model replaced by torch weight-only packs (or
bitsandbytes layers for nf4 / fp4 and CUDA int8), the engine's tokens unchanged in float32, the
chosen format on the startup line, bad combinations refused before loading (bitsandbytes missing,
formats a device cannot run), and SmolLM2's teacher-forced quality per format."""

import sys

import gguf
import pytest
import torch
from tiny_engine import ByteTokenizer
from tiny_gguf import write_tiny_llama

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.request import SamplingParams
from llmd.models.errors import GGUFLoadError
from llmd.models.gguf_loader import cache_mode, load_model
from llmd.models.weight_bytes import cpu_has_avx512_bf16
from llmd.quant.bnb_linear import BnbLinear
from llmd.quant.packed_linear import PackedLinear

T = gguf.GGMLQuantizationType
KW = dict(device="cpu", attention_backend="torch", kv_cache_memory=4 * 2**20, threads=1, prefix_cache_seed=0)


def _linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("qtype,kind", [(T.Q4_0, "int4"), (T.Q4_1, "int4"), (T.Q8_0, "int8")])
def test_every_projection_is_packed_and_logits_match(tmp_path, qtype, kind):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, qtype=qtype)
    dense, _ = load_model(str(path), torch.float32)
    packed, _ = load_model(str(path), torch.float32, weight_quant="gguf")
    assert _linears(packed) == []  # nothing dense is left to read
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 2 * 4 + 1 and {m.kind for m in layers} == {kind}  # qkv, o, gate_up, down; lm_head
    assert all(m.dense is None for m in layers[:-1])  # the tied head keeps the embedding table for batches
    s = packed.weight_quant_summary
    assert (s.int4, s.int8, s.dense) == ((9, 0, []) if kind == "int4" else (0, 9, []))
    h = torch.randn(3, 64)
    for a, b in zip(dense.layers, packed.layers):
        ref = a.self_attn.qkv_proj(h)
        assert (b.self_attn.qkv_proj(h) - ref).abs().max() < (1e-5 if kind == "int4" else 2e-2) * ref.abs().max()
    logits_d, logits_p = dense.compute_logits(h[:1]), packed.compute_logits(h[:1])
    assert (logits_d - logits_p).abs().max() < (1e-4 if kind == "int4" else 3e-2) * logits_d.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_is_groups_of_32_everywhere(tmp_path, dtype):
    """``int8`` packs every projection and the tied head as int8 per 32 input columns; in float32
    a layer computes exactly ``F.linear`` over ``codes · scale`` of the float32 weight."""
    from llmd.quant import int8_groups

    path = tmp_path / "m.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, qtype=T.Q4_1)
    dense, _ = load_model(str(path), torch.float32)
    model, _ = load_model(str(path), dtype, weight_quant="int8")
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert _linears(model) == [] and len(layers) == 9 and {m.kind for m in layers} == {"int8g"}
    s = model.weight_quant_summary
    assert (s.int4, s.int8, s.dense) == (0, 9, []) and s.describe().startswith("weights int8 (groups of 32): 9 int8 ")
    w = dense.layers[0].mlp.down_proj.weight.data
    codes, scale = int8_groups.quantize(w, dtype)
    h = torch.randn(3, w.shape[1])
    got = model.layers[0].mlp.down_proj(h.to(dtype)).double()
    want = h.double() @ (codes.double().view(w.shape[0], -1, 32) * scale.double()[..., None]).view(w.shape).t()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got - want).abs().max() <= tol * want.abs().max()


PROMPTS = [[5, 6, 7], [40, 41], [100, 3, 9, 27, 31, 2, 8]]


def _tokens(model, path, max_num_seqs=64):
    engine = Engine(model, ByteTokenizer(), EngineConfig(model=str(path), dtype="float32",
                                                         max_num_seqs=max_num_seqs, **KW))
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    out = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return list(out.values())


def test_engine_tokens_equal_dense_in_float32_and_auto_dispatch(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, qtype=T.Q4_1)
    dense_tokens = _tokens(load_model(str(path), torch.float32)[0], path)
    assert _tokens(load_model(str(path), torch.float32, weight_quant="gguf")[0], path) == dense_tokens
    both, _ = load_model(str(path), torch.float32, weight_quant="gguf", keep_dense=True)
    layers = [m for m in both.modules() if isinstance(m, PackedLinear) and m is not both.logits_proj]
    # float32 with dense copies (auto on a float32 CPU model): torch's int4 kernel is ~30x slower on
    # float32 activations, so every step reads the dense weights (the packs serve the fused kernel)
    assert {m.small_batch for m in layers} == {0}
    saved = [m.scales.clone() for m in layers]
    for m in layers:
        m.scales.fill_(float("nan"))
    assert _tokens(both, path, max_num_seqs=1)[:2] == dense_tokens[:2]
    for m, sc in zip(layers, saved):  # the <= 4-row dispatch (bfloat16's): poison the dense copies instead
        m.scales.copy_(sc)
        m.small_batch = 4
        m.dense.data.fill_(float("nan"))
    # one sequence at a time: every step has <= 3 rows (prompts of <= 3 tokens, then decodes)
    assert _tokens(both, path, max_num_seqs=1)[:2] == dense_tokens[:2]
    line = Engine(both, ByteTokenizer(), EngineConfig(model=str(path), dtype="float32", **KW)).runtime_summary()
    assert "weights gguf: 9 int4 + 0 int8 layers" in line
    assert "MiB dense for steps the fused kernel does not take" in line  # the line says which weights serve what
    bf16 = load_model(str(path), torch.bfloat16, weight_quant="gguf", keep_dense=True)[0].weight_quant_summary
    assert " MiB for steps of <= 4 tokens + " in bf16.describe() and " MiB dense for larger steps" in bf16.describe()
    packs_only = load_model(str(path), torch.bfloat16, weight_quant="gguf")[0].weight_quant_summary.describe()
    assert "for steps" not in packs_only and "dense for" not in packs_only


@pytest.mark.parametrize("fmt,dtype", [("nf4", torch.bfloat16), ("fp4", torch.float32)])
def test_bitsandbytes_formats_replace_every_projection(tmp_path, fmt, dtype):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, qtype=T.Q4_1)
    model, _ = load_model(str(path), dtype, weight_quant=fmt)
    layers = [m for m in model.modules() if isinstance(m, BnbLinear)]
    assert _linears(model) == [] and len(layers) == 2 * 4 + 1 and {m.kind for m in layers} == {fmt}
    assert model.logits_proj is layers[-1]  # the tied head too; the embedding lookup keeps the dense table
    layout = "cpu" if dtype == torch.bfloat16 and cpu_has_avx512_bf16() else "plain"
    s = model.weight_quant_summary
    assert (s.bnb, s.int4, s.int8, s.dense, s.layouts) == (9, 0, 0, [], [layout])
    assert s.describe().startswith(f"weights {fmt} (bitsandbytes, {layout} layout): 9 {fmt} layers, ")


def test_nf4_engine_tokens_equal_a_dense_model_of_its_weights(tmp_path):
    """float32 nf4 (bitsandbytes' plain layout: dequantize + F.linear) gives the greedy tokens of a
    dense model holding each layer's dequantized nf4 weight (the tied head as a separate linear)."""
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, qtype=T.Q4_1)
    nf4, _ = load_model(str(path), torch.float32, weight_quant="nf4")
    dense, _ = load_model(str(path), torch.float32)
    functional = sys.modules["bitsandbytes"].functional
    for name, m in nf4.named_modules():
        if isinstance(m, BnbLinear):
            w = functional.dequantize_4bit(m.packed, m.quant_state())
            if name == "logits_proj":
                dense.logits_proj = torch.nn.Linear(64, 256, bias=False)
                dense.logits_proj.weight.data = w
            else:
                dense.get_submodule(name).weight.data.copy_(w)
    assert _tokens(nf4, path) == _tokens(dense, path)


def test_bitsandbytes_formats_on_cuda_and_without_bitsandbytes(tmp_path, monkeypatch):
    """The CUDA decisions at configuration (no GPU here: ``torch.cuda.is_available`` patched), and
    bitsandbytes missing (its import patched to fail): one clear line before any weights load."""
    from click.testing import CliRunner

    from llmd.daemon.cli.main import main

    def resolve(**kw):
        return EngineConfig(**kw).resolve()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for fmt in ("nf4", "fp4", "int8"):
        c = resolve(device="cuda", weight_quant=fmt)
        assert (c.weight_quant, c.dtype, c.enforce_eager) == (fmt, "bfloat16", True)  # no CUDA graphs over them
    assert resolve(device="cuda").weight_quant == "none" and not resolve(device="cuda").enforce_eager
    with pytest.raises(LlmdError, match="runs on CPU only .*on CUDA use none, int8 or nf4"):
        resolve(device="cuda", weight_quant="gguf")
    with pytest.raises(LlmdError, match="bfloat16 or float32, got float16"):
        resolve(device="cuda", weight_quant="nf4", dtype="float16")
    with pytest.raises(LlmdError, match="has none"):
        resolve(device="cuda", weight_quant="nf4", model="random:qwen3-0.6b")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises
    with pytest.raises(LlmdError, match=r"--weight-quant int8 on CUDA needs bitsandbytes, which is not installed "
                                        r"\(pip install bitsandbytes==0.50.2\)"):
        resolve(device="cuda", weight_quant="int8")
    assert resolve(device="cpu", weight_quant="int8", dtype="bfloat16").weight_quant == "int8"  # torch's kernel
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, qtype=T.Q4_1)
    r = CliRunner().invoke(main, ["generate", "hi", "--model", str(path), "--device", "cpu", "--weight-quant", "nf4"])
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        "llmd: error: --weight-quant nf4 needs bitsandbytes, which is not installed (pip install bitsandbytes==0.50.2)"]
    with pytest.raises(GGUFLoadError, match="--weight-quant fp4: bitsandbytes failed to import"):
        load_model(str(path), torch.float32, weight_quant="fp4")  # past the configuration, still one line
    assert cache_mode("nf4", "cpu") == "nf4@cpu|bitsandbytes0.50.2" != cache_mode("nf4", "cuda")
    assert cache_mode("int8", "cpu") == "int8" != cache_mode("int8", "cuda")


def test_bad_combinations_fail_before_loading(monkeypatch):
    from llmd.daemon.core import config as config_module

    def resolve(**kw):
        return EngineConfig(**{"device": "cpu", **kw}).resolve()

    with pytest.raises(LlmdError, match="--weight-quant must be one of"):
        resolve(weight_quant="nf5")
    with pytest.raises(LlmdError, match="bfloat16 or float32"):
        resolve(weight_quant="gguf", dtype="float64", attention_backend="torch")
    with pytest.raises(LlmdError, match="has none"):
        resolve(weight_quant="int8", model="random:qwen3-0.6b")
    auto16 = resolve(dtype="bfloat16")
    assert (auto16.weight_quant, auto16.keep_dense) == ("gguf", True)
    assert resolve(dtype="float32").weight_quant == "none"  # explicit float32: dense, exact tokens
    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: False)  # an AVX2-only CPU
    auto32 = resolve()  # float32 by --dtype auto: packs for the fused batch-1 kernel, dense float32 for the rest
    assert (auto32.dtype, auto32.weight_quant, auto32.keep_dense, auto32.packs_for_fused_only) == \
        ("float32", "gguf", True, True)
    gemma = type("Cfg", (), {"architecture": "gemma3", "num_heads": 4, "num_kv_heads": 1, "head_dim": 256})()
    assert auto32.settle_weight_quant(gemma) is False and auto32.weight_quant == "none"  # no fused kernel: dense
    llama = type("Cfg", (), {"architecture": "llama", "num_heads": 9, "num_kv_heads": 3, "head_dim": 64})()
    big = resolve(dtype="bfloat16", block_size=256)  # past the C kernels' blocks: no fused-decode copy of the packs
    assert big.wants_fused_decode(llama) is False and big.weight_quant == "gguf"
    from llmd.kernels import cpu_fused
    assert resolve(dtype="bfloat16", block_size=128).wants_fused_decode(llama) is cpu_fused.available(64, 3)
    assert resolve(model="random:qwen3-0.6b").weight_quant == "none"
    assert (resolve(dtype="bfloat16", weight_quant="gguf").keep_dense) is False


# teacher-forced ΔNLL vs the float32-dequantized model (dense) and top-1 agreement, bfloat16 packs
# on the first 1,000 tokens of the kv-quality text
QUALITY = {"gguf": (0.2, 0.955)}


def _text_ids(tokenizer, long: bool = False, tokens: int = 1000) -> list[int]:
    from llmd.daemon.bench.kv_quality_text import LONG_QUALITY_TEXT, QUALITY_TEXT

    return tokenizer.encode(LONG_QUALITY_TEXT) if long else tokenizer.encode(QUALITY_TEXT)[:tokens]


def _base(smollm2, tokenizer, ids, chunk=64):
    from llmd.daemon.bench.kv_quality import quality_row

    kw = dict(device="cpu", kv_cache_memory=(64 if len(ids) <= 1000 else 256) * 2**20, attention_backend="torch",
              threads=torch.get_num_threads())
    return ids, quality_row(smollm2[0], tokenizer, ids, "auto", None, chunk, dtype="float32", **kw), kw


@pytest.fixture(scope="module")
def float32_base(smollm2, smollm2_tokenizer):
    """The float32 dense model's teacher-forced row on the kv-quality text (the base of gguf and
    the fused decode)."""
    return _base(smollm2, smollm2_tokenizer, _text_ids(smollm2_tokenizer))


@pytest.fixture(scope="module")
def float32_long_base(smollm2, smollm2_tokenizer):
    """The same on the long kv-quality text (2,165 tokens): ΔNLL of 0.05 % needs it (README
    "Weights": on 1,000 tokens int8 schemes scatter over ±0.2 %). Chunks of 256 (13 s instead of
    28 s; int8's figures equal chunks of 64's to the digits below)."""
    return _base(smollm2, smollm2_tokenizer, _text_ids(smollm2_tokenizer, long=True), chunk=256)


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_path):
    """SmolLM2 in bfloat16 with ``gguf`` packs and the fused decode kernel's copy, loaded once."""
    return load_model(smollm2_path, torch.bfloat16, weight_quant="gguf", native=True)[0]


def test_smollm2_gguf_quality(float32_base, smollm2_gguf, smollm2_tokenizer):
    from llmd.daemon.bench.kv_quality import quality_row

    ids, base, kw = float32_base
    row = quality_row(smollm2_gguf, smollm2_tokenizer, ids, "auto", base, dtype="bfloat16", **kw)
    max_dnll, min_top1 = QUALITY["gguf"]
    if not cpu_has_avx512_bf16():  # torch's int4 kernel on emulated bf16 (AVX2): measured
        max_dnll = 0.3  # +0.275 % / 96.8 % on a Zen 3 (+0.080 % where the CPU has AVX512-BF16)
    assert row.delta_nll_pct <= max_dnll and row.top1 >= min_top1, (row.delta_nll_pct, row.top1)


def test_smollm2_int8_quality_on_the_long_text(float32_long_base, smollm2_path, smollm2_tokenizer):
    """float32 ``int8`` (one scale per 32 input columns) on the long text vs the float32 dense
    model: measured ΔNLL +0.041 %, top-1 97.32 % with chunks of 64 and of 256 (issue 18's bound
    ΔNLL ≤ 0.05 %; per-row int8 gave +0.075 % / 96.11 %), 2026-12-03. (bfloat16 there: +0.167 % / 95.38 %, the bfloat16
    dense model alone −0.004 % / 96.72 %: bfloat16 arithmetic, not the codes, decides it; the
    bfloat16 nibble-split kernel is checked by tests/quant/test_int8_groups.py and, in a model,
    by test_int8_is_groups_of_32_everywhere: a teacher-forced model row of it costs ~17 s.)"""
    from llmd.daemon.bench.kv_quality import quality_row

    ids, base, kw = float32_long_base
    model = load_model(smollm2_path, torch.float32, weight_quant="int8")[0]
    assert {m.kind for m in model.modules() if isinstance(m, PackedLinear)} == {"int8g"}
    row = quality_row(model, smollm2_tokenizer, ids, "auto", base, 256, dtype="float32", **kw)
    assert row.delta_nll_pct <= 0.05 and row.top1 >= 0.965, (row.delta_nll_pct, row.top1)


@pytest.fixture(scope="module")
def float32_base_320(smollm2, smollm2_tokenizer):
    """The float32 dense row on the text's first 320 tokens (nf4's coarse check)."""
    return _base(smollm2, smollm2_tokenizer, _text_ids(smollm2_tokenizer, tokens=320))


def test_smollm2_nf4_quality_on_320_tokens(float32_base_320, smollm2_path, smollm2_tokenizer):
    """nf4 re-quantizes the file's Q4_1 blocks (README "Weights"); on the first 320 tokens of the
    text (bfloat16, bitsandbytes' CPU layout here) measured ΔNLL +48.9 %, top-1 54.5 % (the
    bfloat16 dense model: +0.42 % / 95.9 %), 2026-12-03. Two-sided bounds: a dense or a broken
    format fails, and so does a +10 pp regression of the format's path."""
    from llmd.daemon.bench.kv_quality import quality_row

    ids, base, kw = float32_base_320
    model = load_model(smollm2_path, torch.bfloat16, weight_quant="nf4")[0]
    row = quality_row(model, smollm2_tokenizer, ids, "auto", base, dtype="bfloat16", **kw)
    assert 20.0 <= row.delta_nll_pct <= 58.0 and 0.48 <= row.top1 <= 0.70, (row.delta_nll_pct, row.top1)


def test_smollm2_fused_decode_quality(float32_base, smollm2_gguf, smollm2_tokenizer, monkeypatch):
    """The batch-1 decode path (kernels/cpu_fused.py) teacher-forced one token per step over the
    same text: measured +0.015 % ΔNLL, 98.9 % top-1 vs the float32 model (the torch path through
    the same one-token steps: +0.31 %, 94.6 %); every step went through the kernel."""
    from llmd.daemon.bench.kv_quality import quality_row
    from llmd.kernels import cpu_fused

    ids, base, kw = float32_base
    calls = []
    real = cpu_fused.FusedDecoder.__call__
    monkeypatch.setattr(cpu_fused.FusedDecoder, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    row = quality_row(smollm2_gguf, smollm2_tokenizer, ids, "auto", base, chunk=1, dtype="bfloat16",
                      **{**kw, "attention_backend": "cpu"})
    assert len(calls) == len(ids)
    assert row.delta_nll_pct <= 0.05 and row.top1 >= 0.975, (row.delta_nll_pct, row.top1)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.F16])
def test_weight_bytes_from_metadata_equal_the_loaded_model(tmp_path, qtype):
    from llmd.models.gguf_loader import open_gguf
    from llmd.models.llama import LlamaForCausalLM
    from llmd.models.weight_quant import weight_bytes

    path = tmp_path / "m.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, qtype=qtype)
    tensors = {t.name: t for t in open_gguf(str(path)).tensors}
    for mode, keep, fused in (("none", False, False), ("gguf", False, False), ("gguf", True, False),
                              ("gguf", True, True), ("int8", False, False)):
        model, _ = load_model(str(path), torch.bfloat16, weight_quant=mode, keep_dense=keep, native=fused)
        s = model.weight_quant_summary
        assert weight_bytes(tensors, LlamaForCausalLM.layer_tensors, mode, 2, keep, fused=fused) == \
            s.pack_bytes + s.dense_bytes + s.native_bytes
    s = load_model(str(path), torch.float32, weight_quant="int8")[0].weight_quant_summary  # float32 scales
    assert weight_bytes(tensors, LlamaForCausalLM.layer_tensors, "int8", 4) == s.pack_bytes + s.dense_bytes
    for dtype in (torch.bfloat16, torch.float32):  # nf4: bitsandbytes' CPU layout (bf16 absmax) or its plain one
        s = load_model(str(path), dtype, weight_quant="nf4")[0].weight_quant_summary
        cpu_layout = s.layouts == ["cpu"]
        assert cpu_layout == (dtype == torch.bfloat16 and cpu_has_avx512_bf16())
        assert weight_bytes(tensors, LlamaForCausalLM.layer_tensors, "nf4", dtype.itemsize,
                            bnb_cpu_layout=cpu_layout) == s.pack_bytes + s.dense_bytes


def test_kv_size_what_fits(capsys):
    from click.testing import CliRunner

    from llmd.daemon.cli.main import main

    out = CliRunner().invoke(main, ["kv-size", "--total-memory", "1GiB", "--context", "8192"]).output
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert set(rows) == {"none", "auto", "gguf", "int8", "nf4"}
    assert float(rows["nf4"][0]) < float(rows["gguf"][0]) < float(rows["none"][0]) < float(rows["auto"][0])  # MiB
    assert float(rows["gguf"][2]) > float(rows["none"][2])  # more sequences fit beside smaller weights


def test_kv_size_counts_the_engines_tied_head_copy(tmp_path):
    """`llmd kv-size --total-memory`'s weights are what an engine holds: on a CPU that prepacks
    bfloat16 weights, a tied head's packed copy (the startup line's "+N MiB") is in every row but
    nf4's, and the estimate's constant is prepacked's."""
    from llmd.models.gguf_loader import open_gguf
    from llmd.models.weight_bytes import HEAD_COPY_MAX_BYTES, cpu_packs_bf16, tied_head_copy_bytes
    from llmd.quant import prepacked

    assert HEAD_COPY_MAX_BYTES == prepacked.HEAD_COPY_MAX_BYTES
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
    tensors = {t.name: t for t in open_gguf(str(path)).tensors}
    assert tied_head_copy_bytes(tensors) == 256 * 64 * 2 and tied_head_copy_bytes(tensors, 4) == 0
    if not (cpu_packs_bf16() and prepacked.enabled()):
        pytest.skip("this CPU does not prepack bfloat16 weights")
    from tiny_engine import ByteTokenizer

    from llmd.daemon.core.config import EngineConfig
    from llmd.daemon.core.engine import Engine

    for mode in ("none", "int8"):
        model, _ = load_model(str(path), torch.bfloat16, weight_quant=mode)
        cfg = EngineConfig(model=str(path), device="cpu", dtype="bfloat16", attention_backend="cpu",
                           kv_cache_memory=4 << 20, weight_quant=mode).resolve()
        engine = Engine(model, ByteTokenizer(), cfg)
        assert prepacked.head_copy_bytes(engine.runner.model) == tied_head_copy_bytes(tensors), mode
