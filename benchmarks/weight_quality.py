"""Teacher-forced quality per ``--weight-quant`` against the model's float32 dense weights.

The protocol of README "Weights" (and ``tests/models/test_weight_quant.py``): the first 1,000
tokens of the kv-quality text, chunks of 64, the torch attention backend; ΔNLL (%) and top-1
agreement of each format (in ``--dtype``) against the float32 dense model of the same GGUF.

    python benchmarks/weight_quality.py --model gemma3-270m --formats none,gguf,int8,nf4
    python benchmarks/weight_quality.py --long --dtype float32 --formats int8   # the long text (~2,150 tokens)
"""

from __future__ import annotations

import argparse
import time

import torch

from llmd.daemon.bench.kv_quality import quality_row
from llmd.daemon.bench.kv_quality_text import LONG_QUALITY_TEXT, QUALITY_TEXT
from llmd.models.gguf_loader import load_model
from llmd.models.header_cache import header_info
from llmd.models.registry import resolve_model
from llmd.models.tokenizer import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="none,gguf,int8,nf4")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--long", action="store_true", help="the whole long kv-quality text instead")
    a = ap.parse_args()
    path = resolve_model(a.model)
    base_model, cfg = load_model(path, torch.float32)
    tok = load_tokenizer(path, cfg, header_info(path).data_offset)
    ids = tok.encode(LONG_QUALITY_TEXT) if a.long else tok.encode(QUALITY_TEXT)[: a.tokens]
    kw = dict(device="cpu", kv_cache_memory=(256 if a.long else 64) * 2**20, attention_backend="torch",
              threads=torch.get_num_threads())
    base = quality_row(base_model, tok, ids, "auto", None, dtype="float32", **kw)
    del base_model
    print(f"{a.model}: {len(ids)} tokens, {a.dtype} vs the float32 dense model (NLL {base.nll:.4f})")
    for fmt in a.formats.split(","):
        t0 = time.perf_counter()
        model = load_model(path, getattr(torch, a.dtype), weight_quant=fmt)[0]
        row = quality_row(model, tok, ids, "auto", base, dtype=a.dtype, **kw)
        print(f"  {fmt:<6} dNLL {row.delta_nll_pct:+.3f} %  top-1 {100 * row.top1:.1f} %  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del model


if __name__ == "__main__":
    main()
