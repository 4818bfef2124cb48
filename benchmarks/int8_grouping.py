"""What int8 weight grouping would buy: teacher-forced quality of int8 fake quantizations.

Every linear layer's float32 weight ``w [N, K]`` is replaced by its int8 round trip
(``round(w / s) · s``, symmetric, ``s = absmax / 127``) under one scheme, in float32, and the
model runs the protocol of README "Weights" (the first 1,000 tokens of the kv-quality text,
chunks of 64, the torch attention backend) against its own float32 dense run. Schemes:

* ``rows``: one scale per output row (what ``--weight-quant int8`` runs: torch's
  ``_weight_int8pack_mm``);
* ``g32`` / ``g64`` / ``g128``: one scale per row and group of that many input columns (no
  torch CPU kernel has this layout; llama.cpp's Q8_0 is ``g32``);
* ``eq0.5`` / ``eq1``: per-row scales after dividing each input column by ``colmax ** alpha``
  (weight-only column equalization, the weight half of SmoothQuant's migration; the column
  factors would be folded into the activations).

The embedding and the (tied) head stay dense: only the layers' error is measured.

    python benchmarks/int8_grouping.py --model gemma3-270m rows g128 g64 g32 eq0.5
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from llmd.daemon.bench.kv_quality import quality_row
from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT
from llmd.models.gguf_loader import load_model, open_gguf
from llmd.models.registry import resolve_model
from llmd.models.tokenizer import load_tokenizer


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` float32 → its per-row symmetric int8 round trip, float32 ``[N, K]``."""
    s = w.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
    return (w / s).round().clamp(-127, 127) * s


def int8_groups(group: int):
    """The round trip with one scale per row and ``group`` input columns (K % group == 0)."""
    def trip(w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        if k % group:
            raise ValueError(f"K = {k} is not a multiple of {group}")
        return int8_rows(w.reshape(n * (k // group), group)).reshape(n, k)
    return trip


def int8_equalized(alpha: float):
    """Per-row int8 of ``w / colmax ** alpha``, multiplied back (column equalization)."""
    def trip(w: torch.Tensor) -> torch.Tensor:
        c = w.abs().amax(0, keepdim=True).clamp_min(1e-30) ** alpha
        return int8_rows(w / c) * c
    return trip


SCHEMES = {"rows": int8_rows, "g32": int8_groups(32), "g64": int8_groups(64), "g128": int8_groups(128),
           "eq0.5": int8_equalized(0.5), "eq1": int8_equalized(1.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("schemes", nargs="*", default=["rows", "g128", "g64", "g32"], choices=sorted(SCHEMES))
    args = ap.parse_args()
    path = resolve_model(args.model)
    model, config = load_model(path, torch.float32, "cpu")[:2]
    tokenizer = load_tokenizer(path, config, open_gguf(path).data_offset)
    ids = tokenizer.encode(QUALITY_TEXT)[: args.tokens]
    kw = dict(device="cpu", dtype="float32", kv_cache_memory=64 * 2**20, attention_backend="torch",
              threads=torch.get_num_threads())
    base = quality_row(model, tokenizer, ids, "auto", None, **kw)
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    dense = [m.weight.data.clone() for m in layers]
    print(f"{args.model}: {len(ids)} tokens, {len(layers)} linear layers, float32")
    for name in args.schemes:
        try:
            for m, w in zip(layers, dense):
                m.weight.data.copy_(SCHEMES[name](w))
        except ValueError as e:
            print(f"{name:6s} n/a ({e})")
            continue
        t0 = time.perf_counter()
        row = quality_row(model, tokenizer, ids, "auto", base, **kw)
        print(f"{name:6s} ΔNLL {row.delta_nll_pct:+.3f} %  top-1 {100 * row.top1:.2f} %  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    for m, w in zip(layers, dense):
        m.weight.data.copy_(w)


if __name__ == "__main__":
    main()
