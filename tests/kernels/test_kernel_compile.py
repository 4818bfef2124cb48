"""The Triton kernels compiled for real GPUs (sm_80, sm_90) down to cubin, on CPU (issue 15).

``TRITON_INTERPRET=1`` (``test_kernels.py``) checks numerics but never compiles: it let a plain
Python global (``NEG``) through that no GPU build accepts. Here each kernel the engine launches
is compiled by Triton's own pipeline (TTIR → TTGIR → LLVM → PTX → cubin through the ``ptxas``
inside the triton wheel) for ``GPUTarget("cuda", 80, 32)`` and ``("cuda", 90, 32)``. No GPU is
needed: the launches come from the launchers' own ``*_launch`` functions (``llmd.kernels``) fed
CPU tensors of the engine's shapes and dtypes, and the arguments go through the JIT's own binder
(``create_function_from_signature`` + ``JITFunction._pack_args``, as ``JITFunction.run`` does),
so signature, constexprs, divisibility attributes and ``num_warps`` are exactly what the engine
would compile on a GPU. ptxas' ``-v`` report (``TRITON_DUMP_PTXAS_LOG``) gives registers and
spills: none may spill. Found by it: ``NEG`` a plain global (a NameError in every attention
kernel), no ``fp8e4nv`` on sm_80 (now a uint8 software path), spills of up to 75 KB with the old
prefill tiles. 57 cases: 43 s on 2 cores (85 s with other work on them).

Covering set (every value of every dimension paired with every value of every other, greedy,
``tests/fixtures/covering.py``), one table per kernel:

- store_kv: arch × head_dim × model dtype × KV dtype × block size × static/dynamic scales × KV heads;
- decode (split kernel; splits > 1 also compile the merge kernel with SPLITS_PAD 4/16/64):
  arch × head_dim × model dtype × KV dtype × block size × GQA group × window × splits (1 = direct);
- prefill: arch × head_dim × model dtype × KV dtype × block size × GQA group × window;
- decode_int4 / prefill_int4 (the int4 KIVI kernels, ``kivi_decode.py`` / ``kivi_prefill.py``):
  arch × head_dim × model dtype × block size × GQA group (1, 3, 8) × window (× splits 1 / 16 for
  decode). Found by it: per-token scale / zero-point tiles, ``tl.interleave`` unpacking and two
  score tiles per key tile spilled up to 9 KB; the kernels now work on channel halves, one block's
  scale vectors per tile and one score tile at a time (24 more cases: ~50 s on 2 cores).

``LLMD_FULL_COMPILE_MATRIX=1`` compiles the full cross products instead (~6,000 variants, hours
on 2 cores). Compiles run in 2 spawned processes with a fresh ``TRITON_CACHE_DIR``
(Triton's on-disk cache could otherwise serve a kernel compiled earlier under other settings)
and ``always_compile`` (so every variant runs ptxas and reports its registers); they start beside
the single-threaded interpreter tests, one at a time, and these tests run after those
(``tests/kernels/conftest.py``).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import time
import warnings

import pytest
import torch
from covering import pairwise

ARCHS = [80, 90]
HEAD_DIMS = [64, 128, 256]
DTYPES = ["bfloat16", "float16", "float32"]
KV = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]
GROUPS = [1, 3, 4, 8]
#: KV heads per GQA group size, from real models: SmolLM2 (9 heads / 3 KV), Llama-3-8B (32 / 8),
#: Gemma-like single KV head; the KV head count sets strides (1 is specialized by the JIT).
NUM_KV_HEADS = {1: 2, 3: 3, 4: 8, 8: 1}
DIMS = {
    "store_kv": {"arch": ARCHS, "head_dim": HEAD_DIMS, "dtype": DTYPES, "kv": KV, "block_size": [16, 32],
                 "static": [False, True], "num_kv_heads": [1, 3, 8]},
    "decode": {"arch": ARCHS, "head_dim": HEAD_DIMS, "dtype": DTYPES, "kv": KV, "block_size": [16, 32],
               "group": GROUPS, "window": [None, 512], "splits": [1, 3, 16, 64]},
    "prefill": {"arch": ARCHS, "head_dim": HEAD_DIMS, "dtype": DTYPES, "kv": KV, "block_size": [16, 32],
                "group": GROUPS, "window": [None, 512]},
    # int4 (KIVI) has its own kernels (kivi_decode.py, kivi_prefill.py; the merge is the one above);
    # group 4 pads like 3 (GROUP_PAD 4 in prefill, 16 in decode), so it is left out here
    "decode_int4": {"arch": ARCHS, "head_dim": HEAD_DIMS, "dtype": DTYPES, "block_size": [16, 32],
                    "group": [1, 3, 8], "window": [None, 512], "splits": [1, 16]},
    "prefill_int4": {"arch": ARCHS, "head_dim": HEAD_DIMS, "dtype": DTYPES, "block_size": [16, 32],
                     "group": [1, 3, 8], "window": [None, 512]},
}
FULL = os.environ.get("LLMD_FULL_COMPILE_MATRIX") == "1"


def _cases(kernel: str) -> list[dict]:
    dims = DIMS[kernel]
    if FULL:
        return [dict(zip(dims, vals)) for vals in itertools.product(*dims.values())]
    rows = pairwise(dims, seed=0)
    if "static" not in dims:
        return rows
    # static scales exist only for quantized caches: such rows become dynamic, and each pair of
    # static=True that they alone covered gets an int8 row of its own
    for row in rows:
        if row["static"] and row["kv"] == "auto":
            row["static"] = False
    for name, values in dims.items():
        for v in values:
            if name != "static" and (name, v) != ("kv", "auto") and not any(r["static"] and r[name] == v for r in rows):
                rows.append({**rows[0], "kv": "int8", "static": True, name: v})
    return rows


CASES = [(k, c) for k in DIMS for c in _cases(k)]


def _case_id(kernel_case) -> str:
    kernel, case = kernel_case
    return kernel + "-" + "-".join(f"{v}" for v in case.values())


def _launches(kernel: str, case: dict):
    """The Launch objects the engine would run for this case (CPU tensors, engine-like sizes)."""
    from llmd.kernels.decode_attention import decode_launches
    from llmd.kernels.kv_store import store_kv_launch
    from llmd.kernels.prefill_attention import prefill_launch
    from llmd.quant.kv import PagedKVCache, get_format

    dt, hd, bs, arch = getattr(torch, case["dtype"]), case["head_dim"], case["block_size"], case["arch"]
    nkv = case["num_kv_heads"] if kernel == "store_kv" else NUM_KV_HEADS[case["group"]]
    fmt = get_format(case.get("kv", "int4"))
    num_blocks = 4096 // bs + 1
    static = (0.05, 0.1) if case.get("static") and fmt.quantized else None
    cache = PagedKVCache.allocate((2, num_blocks, bs, nkv, hd), fmt, dt, "cpu", static_scales=static,
                                  residual_slots=4)
    if kernel == "store_kv":
        k = torch.zeros(37, nkv, hd, dtype=dt)
        return [store_kv_launch(k, k, cache, torch.arange(37) + bs, capability=arch)]
    nh, batch = nkv * case["group"], 4
    tables = torch.zeros(batch, 2048 // bs, dtype=torch.int32)
    seq_lens = torch.tensor([1000, 7, 300, 2048], dtype=torch.int32)
    if kernel.endswith("_int4"):
        return _int4_launches(kernel, case, cache, tables, seq_lens, nh, dt)
    if kernel == "decode":
        q = torch.zeros(batch, nh, hd, dtype=dt)
        return decode_launches(q, cache, tables, seq_lens, 2048, hd**-0.5, case["window"], case["splits"],
                               capability=arch)[1]
    qlens = [100, 7, 1, 300]
    q = torch.zeros(sum(qlens), nh, hd, dtype=dt)
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    return [prefill_launch(q, cache, tables, qsl, seq_lens, max(qlens), hd**-0.5, case["window"], capability=arch)[1]]


def _int4_launches(kernel: str, case: dict, cache, tables, seq_lens, nh: int, dt: torch.dtype):
    """The int4 kernel's launch (decode: the split kernel only; its merge is the int8/fp8 one):
    ``own`` the residual rows (decode) or the step's exact K (prefill), as ``kivi_triton`` passes them."""
    from llmd.kernels.kivi_decode import kivi_decode_launches
    from llmd.kernels.kivi_prefill import kivi_prefill_launch

    hd, batch = case["head_dim"], seq_lens.shape[0]
    own_rows = torch.arange(batch, dtype=torch.int64) * cache.block_size
    if kernel == "decode_int4":
        q = torch.zeros(batch, nh, hd, dtype=dt)
        own = cache.residual.view(-1, *cache.residual.shape[2:])
        return kivi_decode_launches(q, cache, tables, seq_lens, own, own_rows, 2048, hd**-0.5, case["window"],
                                    case["splits"])[1][:1]
    qlens = [100, 7, 1, 300]
    q = torch.zeros(sum(qlens), nh, hd, dtype=dt)
    own = torch.zeros(sum(qlens) + 64, cache.data.shape[3], hd, dtype=cache.residual.dtype)
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    return [kivi_prefill_launch(q, cache, tables, qsl, seq_lens, own, own_rows, max(qlens), hd**-0.5,
                                case["window"])[1]]


def _compile(launch, arch: int) -> dict:
    """Compile one Launch for ``sm_<arch>`` the way ``JITFunction.run`` would, minus the driver."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fn = launch.kernel
    kwargs = dict(launch.kwargs, debug=fn.debug or knobs.runtime.debug)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {
        "kernel": fn.__name__, "seconds": time.perf_counter() - t0, "has_cubin": "cubin" in compiled.asm,
        "cubin_bytes": len(compiled.asm.get("cubin", b"")), "num_warps": compiled.metadata.num_warps,
        "registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spills.group(1)) if spills else None,
        "signature": {k: v for k, v in signature.items() if v != "constexpr"},
    }


def compile_case(kernel: str, case: dict) -> list[dict] | str:
    """Worker: every launch of one case compiled for its arch; a failure comes back as text."""
    try:
        return [_compile(launch, case["arch"]) for launch in _launches(kernel, case)]
    except Exception as e:  # noqa: BLE001 (the message is the test's failure report)
        return f"{type(e).__name__}: {str(e)[-3000:]}"


def _init_worker(cache_dir: str) -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    os.environ.pop("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", None)  # the very setting that hid NEG
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def compiled(background_compiles):
    """case id → Future of :func:`compile_case`: the selected cases (``-k`` applies) in 2 spawned
    workers, started beside the interpreter tests (tests/kernels/conftest.py), both workers busy
    from here on."""
    background_compiles.widen()
    return background_compiles.results


def test_covering_set_covers_every_pair():
    for kernel, dims in DIMS.items():
        rows = [c for k, c in CASES if k == kernel]
        for (a, xs), (b, ys) in itertools.combinations(dims.items(), 2):
            missing = {(x, y) for x in xs for y in ys} - {(r[a], r[b]) for r in rows}
            if {a, b} == {"static", "kv"}:
                missing -= {(True, "auto"), ("auto", True)}  # static scales need a quantized cache
            assert not missing, (kernel, a, b, missing)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel_case", CASES, ids=_case_id)
def test_compiles_to_cubin(kernel_case, compiled):
    """Each launch of the case reaches a cubin and does not spill (ptxas ``-v``; the tiles and warps
    per model dtype in ``prefill_tile`` / ``decode_options`` were set from this report). Registers,
    spills, warps and cubin size are printed per kernel (``pytest -rP`` shows them)."""
    kernel, case = kernel_case
    res = compiled[_case_id(kernel_case)].result()
    assert not isinstance(res, str), res
    for r in res:
        print(f"{r['kernel']:<22} sm_{case['arch']} {r['registers']} regs, {r['spill_bytes']} B spilled, "
              f"{r['num_warps']} warps, cubin {r['cubin_bytes']} B, {r['seconds']:.1f} s")
        assert r["has_cubin"] and r["cubin_bytes"] > 0
        assert r["spill_bytes"] == 0, f"{r['kernel']} spills {r['spill_bytes']} B on sm_{case['arch']}: {case}"


def test_e4m3_before_sm89_is_bits_in_uint8():
    """sm_80 has no fp8e4nv in Triton: the launchers pass e4m3 caches as uint8 with the software
    codec on, sm_89+ natively; other formats are native everywhere."""
    from llmd.kernels.launch import fp8_e4m3_in_software

    launch = _launches("store_kv", {"arch": 80, "head_dim": 64, "dtype": "bfloat16", "kv": "fp8_e4m3",
                                    "block_size": 16, "num_kv_heads": 1})[0]
    assert launch.kwargs["E4M3_SW"] and launch.args[3].dtype == torch.uint8
    assert fp8_e4m3_in_software("fp8_e4m3", 80) and fp8_e4m3_in_software("fp8_e4m3", 86)
    assert not fp8_e4m3_in_software("fp8_e4m3", 89) and not fp8_e4m3_in_software("fp8_e4m3", 90)
    assert not fp8_e4m3_in_software("fp8_e5m2", 80) and not fp8_e4m3_in_software("fp8_e4m3", 0)


@pytest.mark.parametrize("bad, match", [
    (dict(head_dim=80), "head_dim a power of two in 16..256, got 80"),
    (dict(head_dim=512), "head_dim a power of two in 16..256, got 512"),
    (dict(num_heads=10, num_kv_heads=4), r"num_heads \(10\) to be a multiple of num_kv_heads \(4\)"),
    (dict(decode_block_n=24), "decode block_n a power of two >= 16"),
    (dict(prefill_block_n=8), "prefill block_n a power of two >= 16"),
    (dict(model_dtype=torch.float64), "float32/bfloat16/float16 models"),
    (dict(kv_cache_dtype="int2"), "--kv-cache-dtype must be one of"),
])
def test_config_checks_are_one_clear_line(bad, match):
    from llmd.kernels.launch import check_triton_config

    kw = dict(head_dim=64, num_heads=9, num_kv_heads=3, model_dtype=torch.bfloat16, block_size=16) | bad
    with pytest.raises(ValueError, match=match) as exc:
        check_triton_config(**kw)
    assert "\n" not in str(exc.value)
    check_triton_config(64, 9, 3, torch.bfloat16, 16)  # the good one passes
    check_triton_config(64, 9, 3, torch.bfloat16, 16, "int4")  # int4 has kernels (kivi_decode/prefill.py)


def test_int4_is_not_stored_by_the_triton_store_kernel():
    """int4 K waits for the step's residual slots (kernels/kivi.py): the store kernel refuses it in one line."""
    from llmd.kernels.kv_store import store_kv_launch
    from llmd.quant.kv import PagedKVCache, get_format

    cache = PagedKVCache.allocate((2, 3, 16, 1, 64), get_format("int4"), torch.float16, "cpu")
    k = torch.zeros(2, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="int4 KV caches store through llmd.kernels.kivi"):
        store_kv_launch(k, k, cache, torch.tensor([16, 17]))
