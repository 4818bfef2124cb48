"""What int8 weight grouping would buy: teacher-forced quality of int8 fake quantizations.

Every linear layer's float32 weight ``w [N, K]`` is replaced by its int8 round trip
(``round(w / s) · s``, symmetric, ``s = absmax / 127``: the quantizer of ``--weight-quant
int8``) under one scheme, in float32, and the model runs the protocol of README "Weights"
(the first 1,000 tokens of the kv-quality text, chunks of 64, the torch attention backend)
against its own float32 dense run. Schemes:

* ``rows``: one scale per output row (what ``--weight-quant int8`` runs: torch's
  ``_weight_int8pack_mm``);
* ``g32`` / ``g64`` / ``g128``: one scale per row and group of that many input columns (no
  torch CPU kernel has this layout; llama.cpp's Q8_0 is ``g32``);
* ``eq0.5`` / ``eq1``: per-row scales after dividing each input column by ``colmax ** alpha``
  (weight-only column equalization, the weight half of SmoothQuant's migration; the column
  factors would be folded into the activations).

The embedding and the (tied) head stay dense: only the layers' error is measured.
``--jitter N``: N realizations per scheme, each weight multiplied by ``1 + 1e-6 · ε`` (ε standard
normal, seeded by realization) before the round trip, printed as mean ± sd (case Q4's protocol
for the KV cache; for these weights the spread came out ≤ 0.02 pp, README "Weights").
``--long``: the kv-quality long text.

    python benchmarks/int8_grouping.py --model gemma3-270m rows g128 g64 g32 eq0.5
    python benchmarks/int8_grouping.py --long --jitter 4 rows g32
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from llmd.daemon.bench.kv_quality import quality_row
from llmd.daemon.bench.kv_quality_text import LONG_QUALITY_TEXT, QUALITY_TEXT
from llmd.models.gguf_loader import load_model, open_gguf
from llmd.models.registry import resolve_model
from llmd.models.tokenizer import load_tokenizer
from llmd.quant import gguf_packs


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` float32 → its per-row symmetric int8 round trip, float32 ``[N, K]``, through
    the quantizer ``--weight-quant int8`` uses (:func:`llmd.quant.gguf_packs.int8_rows`)."""
    codes, scale = gguf_packs.int8_rows(w.numpy())
    return torch.from_numpy(codes.astype(np.float32) * scale[:, None])


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
    ap.add_argument("--tokens", type=int, default=1000, help="the text's first N tokens (--long: all of it)")
    ap.add_argument("--long", action="store_true", help="the long kv-quality text")
    ap.add_argument("--jitter", type=int, default=0, help="realizations with 1e-6 relative weight jitter")
    ap.add_argument("schemes", nargs="*", default=["rows", "g128", "g64", "g32"], choices=sorted(SCHEMES))
    args = ap.parse_args()
    path = resolve_model(args.model)
    model, config = load_model(path, torch.float32, "cpu")[:2]
    tokenizer = load_tokenizer(path, config, open_gguf(path).data_offset)
    ids = tokenizer.encode(LONG_QUALITY_TEXT) if args.long else tokenizer.encode(QUALITY_TEXT)[: args.tokens]
    kw = dict(device="cpu", dtype="float32", kv_cache_memory=512 * 2**20, attention_backend="torch",
              threads=torch.get_num_threads())
    base = quality_row(model, tokenizer, ids, "auto", None, **kw)
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    dense = [m.weight.data.clone() for m in layers]
    print(f"{args.model}: {len(ids)} tokens, {len(layers)} linear layers, float32")
    for name in args.schemes:
        rows, t0 = [], time.perf_counter()
        for r in range(max(args.jitter, 1)):
            gen = torch.Generator().manual_seed(r)
            try:
                for m, w in zip(layers, dense):
                    if args.jitter:
                        w = w * (1 + 1e-6 * torch.randn(w.shape, generator=gen))
                    m.weight.data.copy_(SCHEMES[name](w))
            except ValueError as e:
                print(f"{name:6s} n/a ({e})")
                break
            rows.append(quality_row(model, tokenizer, ids, "auto", base, **kw))
        if not rows:
            continue
        d = torch.tensor([x.delta_nll_pct for x in rows], dtype=torch.float64)
        t1 = torch.tensor([100 * x.top1 for x in rows], dtype=torch.float64)
        spread = f" ± {d.std().item():.3f} (n={len(rows)}, [{d.min().item():+.3f}, {d.max().item():+.3f}])" \
            if len(rows) > 1 else ""
        print(f"{name:6s} ΔNLL {d.mean().item():+.3f} %{spread}  top-1 {t1.mean().item():.2f} %  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
