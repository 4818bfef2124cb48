"""The cpu backend's decode attention: C kernel (kernels/cpu_native.py) vs its torch ops, side by side.

A decode-only step of ``--batch`` sequences with ``--context`` cached tokens each, SmolLM2's shapes
(3 KV heads, 9 query heads, head_dim 64, block 16) by default, over ``--layers`` separate caches on
a shuffled block layout (so every layer reads from memory, as a real step does), bfloat16; the
paths alternate for ``--rounds`` rounds and the medians and their ratios are printed. On a CPU with
AMX or AVX512-BF16 the kernel runs twice per round, with its bfloat16 path (scores on the tile
unit, or by VDPBF16PS) and with it off (``cpu_native.set_amx`` / ``set_dot``: the generic vector
kernel), and that ratio is printed too. The kernel also runs over the same caches with their V
planes a whole number of 4 KiB pages after their K planes (the layout before quant/kv.py's
``kv_planes`` skewed them by 2 KiB), and that ratio is printed. And the kernel over one layer's cache
``--layers`` times (12.6 MiB at the defaults: resident in a 32 MiB L3) against ``--layers`` separate
caches: the attention with its reads from L3 instead of DRAM.

    python benchmarks/native_decode.py --batch 32 --context 512 [--kv-cache-dtype int8] [--threads 2]
        [--dtype float32 --kv-cache-dtype float16]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from llmd.kernels import AttentionMetadata, cpu_attention, cpu_native
from llmd.kernels.bench import random_paged_layout
from llmd.quant.kv import PagedKVCache, get_format


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2", "float16"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model (query) dtype")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not cpu_native.prepare(a.head_dim, a.group):
        raise SystemExit("native_decode: the C kernel is unavailable here (see the warning above)")
    model_dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    lens = [a.context] * a.batch
    tables, slots, num_blocks = random_paged_layout(lens, 16, g)
    caches = []
    for _ in range(a.layers):
        c = PagedKVCache.allocate((2, num_blocks, 16, a.kv_heads, a.head_dim), get_format(a.kv_cache_dtype),
                                  model_dtype, "cpu")
        if c.fmt.quantized:
            c.data.view(torch.uint8).random_(0, 100, generator=g)
            c.scales.fill_(0.02)
        else:
            c.data.normal_(generator=g)
        caches.append(c)
    q = torch.randn(a.batch, a.kv_heads * a.group, a.head_dim, generator=g).to(model_dtype)
    aligned = [page_aligned(c) for c in caches]

    def step(native: bool, layers: list[PagedKVCache] = caches) -> float:
        qsl, sl = torch.arange(a.batch + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        meta = AttentionMetadata(torch.tensor([s[-1] for s in slots]), tables, qsl, sl, [1] * a.batch, lens, 16, "cpu",
                                 slots_padded=False, native_kernels=native)
        t0 = time.perf_counter()
        for c in layers:
            cpu_attention.paged_attention(q, c, meta, a.head_dim**-0.5)
        return time.perf_counter() - t0

    tile = cpu_native.tile_scores(model_dtype, model_dtype, 16, a.head_dim)
    fast = "AMX tiles" if tile else "VDPBF16PS" if cpu_native.dot_scores(
        model_dtype, model_dtype, 16, a.head_dim) else None
    fast = fast if a.kv_cache_dtype == "auto" and a.dtype == "bfloat16" else None
    times = {True: [], False: [], "vector": [], "aligned": [], "generic": [], "resident": []}

    def vector_step() -> float:  # the C kernel with its bfloat16 paths off
        cpu_native.set_amx(False, a.head_dim, a.group)
        cpu_native.set_dot(False, a.head_dim, a.group)
        try:
            return step(True)
        finally:
            cpu_native.set_amx(True, a.head_dim, a.group)
            cpu_native.set_dot(True, a.head_dim, a.group)

    def generic_step() -> float:  # the C kernel with decode_avx2.h's loops off (decode_task's own)
        cpu_native.set_avx2(False, a.head_dim, a.group)
        try:
            return step(True)
        finally:
            cpu_native.set_avx2(True, a.head_dim, a.group)

    avx2 = cpu_native.set_avx2(True, a.head_dim, a.group)
    paths = [(True, lambda: step(True)), (False, lambda: step(False)), ("aligned", lambda: step(True, aligned)),
             ("resident", lambda: step(True, [caches[0]] * a.layers))]
    paths += [("vector", vector_step)] if fast else []
    paths += [("generic", generic_step)] if avx2 else []
    for _, run in paths:
        run()  # warm-up (plans, workspaces, first touch)
    for _ in range(a.rounds):
        for key, run in paths:
            times[key].append(run())
    kv_mb = 2 * a.batch * a.context * a.kv_heads * a.head_dim * caches[0].data.element_size() * a.layers / 2**20
    on, off = (statistics.median(times[k]) * 1e3 for k in (True, False))
    print(f"native_decode: batch {a.batch} x {a.context} keys, {a.layers} layers, kv {a.kv_cache_dtype} "
          f"({kv_mb:.0f} MiB read), {a.dtype}, {a.threads} threads, median of {a.rounds} alternating rounds")
    print(f"  C kernel {on:.1f} ms   torch ops {off:.1f} ms   kernel / torch = {on / off:.2f}x")
    al = statistics.median(times["aligned"]) * 1e3
    print(f"  V plane 2 KiB past a page multiple {on:.1f} ms   page-aligned {al:.1f} ms   skewed / aligned = "
          f"{on / al:.2f}x")
    res = statistics.median(times["resident"]) * 1e3
    print(f"  one layer's cache read {a.layers} times ({kv_mb / a.layers:.1f} MiB, in L3 if it fits) {res:.1f} ms   "
          f"{a.layers} layers' caches {on:.1f} ms   resident / from memory = {res / on:.2f}x")
    if avx2:
        gen = statistics.median(times["generic"]) * 1e3
        print(f"  8-lane AVX2 loops (decode_avx2.h) {on:.1f} ms   decode_task's own {gen:.1f} ms   "
              f"avx2 / own = {on / gen:.2f}x")
    if fast:
        vec = statistics.median(times["vector"]) * 1e3
        print(f"  scores by {fast} {on:.1f} ms   generic vector kernel {vec:.1f} ms   "
              f"{fast} / vector = {on / vec:.2f}x")


def page_aligned(cache: PagedKVCache) -> PagedKVCache:
    """A copy of ``cache`` whose V planes (data and scales) start a whole number of 4 KiB pages
    after the K planes: the smallest such gap after one plane."""
    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        plane, size = t[0].numel(), t.element_size()
        stride = -(-plane * size // 4096) * 4096 // size
        out = torch.empty(stride + plane, dtype=t.dtype).as_strided(t.shape, (stride, *t[0].stride()))
        return out.copy_(t)

    return dataclasses.replace(cache, data=copy(cache.data), scales=copy(cache.scales))


if __name__ == "__main__":
    main()
