"""Milliseconds per model forward on a decode step (issue 13: fewer, larger ops per layer).

Usage (repo root, in the venv): ``python benchmarks/model_forward.py [--model smollm2-135m]
[--dtype bfloat16] [--batch 32 1] [--context 64] [--iters 30]``. Each of ``batch`` sequences has
``context`` tokens cached and decodes one more (T = batch query rows), torch attention backend.
Prints the median and the best of ``iters`` timed forwards (after 3 warm-ups). On a machine
shared with other torch processes set ``OMP_NUM_THREADS=1``: oversubscribed threads made the
same forward ~8x slower and the spread several-fold.

Issue 13 (fused Q/K/V and gate/up, RoPE tables once per step, ``F.rms_norm``), SmolLM2-135M
bfloat16, context 64, one thread, HEAD vs the change interleaved in one process (median ms):
batch 32: 201.7 → 197.5 (the torch attention backend's per-sequence loop dominates); batch 1:
42.4 → 39.0; with attention stubbed out, batch 1 best 35.3 → 31.6. Outputs bit-identical in
float32 and bfloat16; aten ops per batch-1 forward 3,219 → 2,001 (float32), matmuls 210 → 120.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmd.kernels import AttentionMetadata
from llmd.models.gguf_loader import load_model
from llmd.models.registry import resolve_model


def decode_step(cfg, dtype, batch: int, context: int, block_size: int = 16):
    """Inputs of one decode step: ``batch`` sequences with ``context`` cached tokens each."""
    blocks_per_seq = (context + 1 + block_size - 1) // block_size
    caches = [torch.zeros(2, 1 + batch * blocks_per_seq, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
              for _ in range(cfg.num_layers)]
    tables = torch.arange(1, 1 + batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    pos = torch.full((batch,), context, dtype=torch.int64)
    slots = tables[:, context // block_size].to(torch.int64) * block_size + context % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
        query_lens_cpu=[1] * batch, seq_lens_cpu=[context + 1] * batch, block_size=block_size, attn_backend="torch",
    )
    ids = torch.randint(0, cfg.vocab_size, (batch,))
    return ids, pos, caches, meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 1])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    model, cfg = load_model(resolve_model(a.model), dtype)
    print(f"{a.model} {a.dtype} threads={torch.get_num_threads()} context={a.context}")
    with torch.inference_mode():
        for batch in a.batch:
            ids, pos, caches, meta = decode_step(cfg, dtype, batch, a.context)
            times = []
            for i in range(3 + a.iters):
                t0 = time.perf_counter()
                model(ids, pos, caches, meta)
                if i >= 3:
                    times.append((time.perf_counter() - t0) * 1e3)
            print(f"  batch {batch:3d}: median {statistics.median(times):7.2f} ms  best {min(times):7.2f} ms")


if __name__ == "__main__":
    main()
