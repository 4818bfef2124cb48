"""The 30 layers' linears of SmolLM2 (and its 49,152-row head) per weight format, side by side.

    python benchmarks/weight_linears.py [--threads 2] [--rounds 7] [--batches 1,32] [--only dense,torch]

Shapes come from the GGUF header (qkv 960×576, o 576×576, gate_up 3072×576, down 576×1536 per
layer; the head 49152×576), weights are random (these kernels' speed does not depend on the
values), activations bfloat16. Formats: the dense bfloat16 weight (``F.linear``, oneDNN); torch's
int4 packs (``_weight_int4pack_mm_for_cpu``, group 32: ``--weight-quant gguf``), per-row int8
(``_weight_int8pack_mm``: ``gguf``'s Q8_0 tensors and head), int8 per 32 input columns
(:mod:`llmd.quant.int8_groups`: CPU ``--weight-quant int8``; the nibble-split int4 kernel for
M <= 4, dequantize + matmul above); bitsandbytes NF4 and FP4 in its CPU layout
(``--weight-quant nf4 / fp4`` on an AVX512-BF16 CPU), NF4 in its plain layout (the CPU fallback:
dequantize + ``F.linear``), and LLM.int8() (``Linear8bitLt``'s path: CUDA ``--weight-quant int8``,
here on the CPU). Each round times every format once (best of 5 passes over the layers; the head
10 calls a timing, so a scheduler time slice cannot swamp a sub-millisecond call),
rounds alternate the formats' order, and the table prints each format's median ms and its ratio
to dense. Run it on a quiet machine; it takes about a minute.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from llmd.models.registry import resolve_model
from llmd.quant import int8_groups
from llmd.quant.bnb_linear import BnbLinear, layout_for, quantize_4bit, quantize_int8
from llmd.quant.packed_linear import PackedLinear, pack_int4, pack_int8


def smollm2_shapes() -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """``([(N, K)] of one layer's four linears, (vocab, hidden))`` from SmolLM2's GGUF header."""
    from llmd.models.header_cache import load_config

    cfg = load_config(resolve_model("smollm2-135m"))
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    return [(h + 2 * kv, h), (h, h), (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)], (cfg.vocab_size, h)


def int4_layer(w: torch.Tensor) -> PackedLinear:
    """Asymmetric int4 in groups of 32 (the GGUF Q4_1 mapping's format), through torch's packs."""
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).view(n, k)
    return PackedLinear(k, n, int4=pack_int4(codes, scale, lo + 8 * scale, torch.bfloat16))


def int8_layer(w: torch.Tensor) -> PackedLinear:
    scale = w.abs().amax(1) / 127
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return PackedLinear(w.shape[1], w.shape[0], int8=pack_int8(codes, scale, torch.bfloat16))


def int8g_layer(w: torch.Tensor) -> PackedLinear:
    """Int8 per 32 input columns, bfloat16 (``--weight-quant int8`` on a CPU)."""
    return PackedLinear(w.shape[1], w.shape[0], int8g=int8_groups.pack(*int8_groups.quantize(w, torch.bfloat16),
                                                                        torch.bfloat16))


def bnb_4bit(w: torch.Tensor, kind: str, layout: str) -> BnbLinear:
    return BnbLinear(w.shape[1], w.shape[0], kind, *quantize_4bit(w, kind, layout), layout)


def build(weights: list[torch.Tensor], only: list[str] | None = None) -> dict[str, list]:
    """Format name → ``(in_features, layer)`` per weight (names starting with one of ``only``)."""
    cpu = "cpu" if all(layout_for(*w.shape, torch.bfloat16, "cpu") == "cpu" for w in weights) else "plain"
    makers = {
        "dense bf16": lambda w: (lambda x, d=w.bfloat16(): F.linear(x, d)),
        "torch int4 g32 (gguf)": int4_layer,
        "torch int8 rows": int8_layer,
        "int8 g32 (cpu int8)": int8g_layer,
        f"bnb nf4 {cpu} (nf4)": lambda w: bnb_4bit(w, "nf4", cpu),
        f"bnb fp4 {cpu} (fp4)": lambda w: bnb_4bit(w, "fp4", cpu),
        "bnb nf4 plain": lambda w: bnb_4bit(w, "nf4", "plain"),
        "bnb LLM.int8()": lambda w: BnbLinear(w.shape[1], w.shape[0], "int8", *quantize_int8(w.numpy())),
    }
    return {name: [(w.shape[1], make(w)) for w in weights] for name, make in makers.items()
            if name == "dense bf16" or not only or any(name.startswith(o) for o in only)}


def time_pass(layers: list, xs: dict[int, torch.Tensor], repeat: int = 1, best_of: int = 5) -> float:
    """Best of ``best_of`` timings of ``repeat`` passes over ``layers`` (ms per pass)."""
    best = float("inf")
    for _ in range(best_of):
        t0 = time.perf_counter()
        for _ in range(repeat):
            for k, layer in layers:
                layer(xs[k])
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--only", default="", help="format name prefixes to time beside dense (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layer_shapes, head_shape = smollm2_shapes()
    g = torch.Generator().manual_seed(0)
    layer_w = [torch.randn(n, k, generator=g) * 0.02 for _ in range(30) for n, k in layer_shapes]  # 30 distinct layers
    head_w = [torch.randn(*head_shape, generator=g) * 0.02]
    only = [o for o in args.only.split(",") if o]
    # the head: 10 calls a timing
    suites = {"30 layers' linears": (build(layer_w, only), 1), "lm_head": (build(head_w, only), 10)}
    print(f"torch {torch.__version__}, {args.threads} threads, bfloat16 activations; median of {args.rounds} rounds")
    for m in [int(b) for b in args.batches.split(",")]:
        for title, (formats, repeat) in suites.items():
            xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {w.shape[1] for w in layer_w + head_w}}
            names = list(formats)
            for name in names:  # warm-up (the 4-bit state, oneDNN primitives)
                time_pass(formats[name], xs)
            times: dict[str, list[float]] = {n: [] for n in names}
            with torch.inference_mode():
                for r in range(args.rounds):
                    for name in names if r % 2 == 0 else names[::-1]:
                        times[name].append(time_pass(formats[name], xs, repeat))
            base = statistics.median(times[names[0]])
            print(f"\n{title}, M = {m}:\n{'format':<24}{'ms':>9}{'x dense':>9}")
            for name in names:
                med = statistics.median(times[name])
                print(f"{name:<24}{med:>9.2f}{med / base:>9.2f}")


if __name__ == "__main__":
    main()
