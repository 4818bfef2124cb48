"""Cascade attention for prefill chunks on one cached prompt: attention of one step, on vs off.

    python benchmarks/cascade_prefill.py [--threads 2] [--chats 32] [--prompt-blocks 64] [--question 11]

The step the shared-prefix workload makes when many chats arrive at once: ``--chats`` prefill
chunks of ``--question`` tokens each, every one after the same cached ``--prompt-blocks`` × 16
tokens (plus 3 tokens of its own last block), SmolLM2's attention shape (3 KV heads × 3 query
heads each, head_dim 64), bfloat16, a random ``auto`` cache. Times ``cpu_attention.paged_attention``
for 30 layers with ``AttentionMetadata.cascade_attn`` on and off, a fresh plan per layer set (as a
step builds one), alternating for 7 rounds; prints both medians and their ratio, and the largest
difference between the two outputs (the same softmax in another reduction order).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from llmd.kernels import AttentionMetadata, cpu_attention
from llmd.quant.kv import PagedKVCache, get_format

BS, KV_HEADS, GROUP, HEAD_DIM, LAYERS = 16, 3, 3, 64, 30


def build(chats: int, prompt_blocks: int, question: int):
    """The cache, the step's pieces of metadata and its queries ``[chats · question, 9, 64]`` bf16."""
    torch.manual_seed(0)
    cache = PagedKVCache.allocate((2, 1 + prompt_blocks + 2 * chats + 2, BS, KV_HEADS, HEAD_DIM), get_format("auto"),
                                  torch.bfloat16, "cpu")
    cache.data.normal_()
    ctx = prompt_blocks * BS + 3
    tables, slots, lens, next_block = [], [], [], 1 + prompt_blocks
    for _ in range(chats):
        own = -(-(ctx + question) // BS) - prompt_blocks
        tables.append(list(range(1, 1 + prompt_blocks)) + list(range(next_block, next_block + own)))
        next_block += own
        pos = torch.arange(ctx, ctx + question)
        slots.append(torch.tensor(tables[-1])[pos // BS] * BS + pos % BS)
        lens.append(ctx + question)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qlens = [question] * chats
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32)
    query = torch.randn(sum(qlens), KV_HEADS * GROUP, HEAD_DIM).to(torch.bfloat16)
    return cache, (torch.cat(slots), block_tables, qsl, torch.tensor(lens, dtype=torch.int32), qlens, lens), query


def run(cache, parts, query, cascade: bool) -> tuple[float, torch.Tensor]:
    """ms for 30 layers' attention with one plan, and the output."""
    meta = AttentionMetadata(*parts, BS, "cpu")
    meta.cascade_attn = cascade
    t0 = time.perf_counter()
    for _ in range(LAYERS):
        out = cpu_attention.paged_attention(query, cache, meta, HEAD_DIM**-0.5)
    return (time.perf_counter() - t0) * 1000, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--prompt-blocks", type=int, default=64)
    ap.add_argument("--question", type=int, default=11)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cache, parts, query = build(a.chats, a.prompt_blocks, a.question)
    diff = (run(cache, parts, query, True)[1].float() - run(cache, parts, query, False)[1].float()).abs().max()
    times = {True: [], False: []}
    for _ in range(a.rounds):
        for cascade in (True, False):
            times[cascade].append(run(cache, parts, query, cascade)[0])
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{a.chats} prefill chunks of {a.question} tokens after a cached {a.prompt_blocks * BS}-token prompt, "
          f"bfloat16, {a.threads} threads, {LAYERS} layers, median of {a.rounds} alternating rounds")
    print(f"cascade on {on:.1f} ms, off {off:.1f} ms: on / off {on / off:.2f}x; max |on - off| {diff:.2e}")


if __name__ == "__main__":
    main()
