"""What 8-bit activations cost in quality: fake-quantized linears in HF transformers (float32).

The first 1,024 tokens of the kv-quality text, one teacher-forced pass of HF's own float32 model
of the same GGUF; every decoder linear (the LM head excepted) gets its weights rounded to int8
per output row and/or its input rounded to int8 with one symmetric scale per token (what a
plain int8 GEMM such as ``torch._int_mm`` or fbgemm's dynamic linear can take) or per block of
32 input columns (llama.cpp's Q8_0 activations, which need a blocked kernel). Prints ΔNLL (%)
and top-1 agreement against the unquantized pass. Measured rows: README "Weights".

    python benchmarks/activation_quant.py [--model smollm2-135m] [--tokens 1024]
    python benchmarks/activation_quant.py --speed   # the int8 product's own speed (SmolLM2 shapes)

``--speed`` times instead what such a path would gain at most: ``torch._int_mm`` (oneDNN's
s8 × s8 → s32) against llmd's prepacked bfloat16 linear (``quant/prepacked.py``) over SmolLM2's
120 layer matmuls (fused QKV 960 × 576, O 576 × 576, gate/up 3072 × 576, down 576 × 1536), best of
5, before any activation quantization or scaling is paid.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT
from llmd.models.registry import resolve_model

MODES = {"weights int8 per row": (True, None), "weights int8 + activations per token": (True, 0),
         "weights int8 + activations per 32 columns": (True, 32), "activations per token only": (False, 0)}


def int8_round(x: torch.Tensor, block: int = 0) -> torch.Tensor:
    """``x`` rounded to symmetric int8 codes × a float scale (amax / 127) per row of its last
    dimension, or per ``block`` columns of it (``block`` must divide it)."""
    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // block, block) if block else x
    scale = xb.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return ((xb / scale).round().clamp(-127, 127) * scale).reshape(shape)


SMOLLM2_MATMULS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer, 30 layers


def speed() -> None:
    """Print ms per 30 layers of SmolLM2's matmuls: prepacked bfloat16 vs ``torch._int_mm``."""
    from llmd.quant.prepacked import _pack, linear

    def best(f, n: int = 20) -> float:
        for _ in range(3):
            f()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                f()
            times.append((time.perf_counter() - t) / n)
        return min(times)

    for m in (8, 32, 64, 256):
        bf16 = int8 = 0.0
        for n, k in SMOLLM2_MATMULS:
            x, w = torch.randn(m, k).bfloat16(), _pack(torch.randn(n, k).bfloat16())
            xi, wi = (torch.randint(-127, 127, s, dtype=torch.int8) for s in ((m, k), (k, n)))
            bf16 += best(lambda: linear(x, w))
            int8 += best(lambda: torch._int_mm(xi, wi))
        print(f"M = {m:>3}: bfloat16 prepacked {30e3 * bf16:6.1f} ms, int8 _int_mm {30e3 * int8:6.1f} ms "
              f"({bf16 / int8:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--speed", action="store_true", help="time the int8 product instead (no model)")
    args = ap.parse_args()
    if args.speed:
        speed()
        return
    path = resolve_model(args.model)
    kw = dict(gguf_file=os.path.basename(path))
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32, **kw).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(os.path.dirname(path), **kw)(QUALITY_TEXT)["input_ids"]
                        [:args.tokens]])

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits[0].float(), -1)

    def nll(lp: torch.Tensor) -> float:
        return -lp[:-1].gather(1, ids[0, 1:, None]).mean().item()

    ref = logprobs()
    linears = [(m, m.forward, m.weight.data.clone()) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    print(f"{args.model}: {ids.shape[1]} tokens, {len(linears)} linears, float32 NLL {nll(ref):.4f}")
    for mode, (weights, block) in MODES.items():
        for mod, forward, w in linears:
            mod.weight.data = int8_round(w) if weights else w
            mod.forward = forward if block is None else (lambda f, b: lambda x: f(int8_round(x, b)))(forward, block)
        lp = logprobs()
        top1 = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{mode:<44} ΔNLL {100 * (nll(lp) / nll(ref) - 1):+.3f} %   top-1 {100 * top1:.1f} %")


if __name__ == "__main__":
    main()
