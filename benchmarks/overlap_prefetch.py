"""Does fetching the next layer's KV blocks during this layer's linears make the decode attention
read from L3 instead of DRAM? A batch-32 decode step's two halves, SmolLM2's shapes, 30 layers,
side by side in one process (alternating, median of ``--rounds``):

* ``onednn + attn``: each layer's four linears by oneDNN (prepacked bfloat16, as llmd runs them),
  then llmd's C decode attention over that layer's cache (shuffled blocks, batch x context keys);
* ``own + attn``: the linears by ``overlap_gemm.c`` (VDPBF16PS, 32 rows in registers) instead;
* ``own+pf + attn``: the same GEMM issuing prefetches of the *next* layer's K/V blocks between its
  multiply-adds (``--per-iter`` lines per channel pair, ``--hint`` 0/1/2 = prefetcht0/t1/t2);
* each half alone: ``onednn``, ``own``, ``own+pf`` (linears only), ``attn`` (attention only).

The question is the README's "The attention's read ceiling per core": ~11 ms of the attention's
16 ms is compute and L3 traffic, the rest reads a core cannot overlap beyond its miss queue, and
the linears leave the miss queues idle. Needs AVX512-BF16 (Zen 4, Sapphire Rapids).

    python benchmarks/overlap_prefetch.py [--rounds 7] [--per-iter 2] [--hint 1]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from llmd.kernels import AttentionMetadata, cpu_attention, cpu_native
from llmd.kernels.bench import random_paged_layout
from llmd.quant import prepacked
from llmd.quant.kv import PagedKVCache, get_format

NT = 12  # overlap_gemm.c's rows per panel


def build() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "overlap_gemm.so"
    src = Path(__file__).with_name("overlap_gemm.c")
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-o", str(out), str(src)],
                   check=True)
    lib = ctypes.CDLL(str(out))
    P = ctypes.c_void_p
    lib.layer_gemms.argtypes = [ctypes.c_int, P, P, P, P, P, P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                ctypes.c_int, ctypes.c_int]
    return lib


def pack_x(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 [32, K] -> int32 [K / 2, 32] (channel pairs, rows across lanes)."""
    return x.contiguous().view(torch.int32).t().contiguous()


def pack_w(w: torch.Tensor) -> torch.Tensor:
    """bfloat16 [N, K] -> int32 [N / NT, K / 2, NT]."""
    n, k = w.shape
    return w.contiguous().view(torch.int32).reshape(n // NT, NT, k // 2).permute(0, 2, 1).contiguous()


def ptrs(ts: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-iter", type=int, default=2)
    ap.add_argument("--hint", type=int, default=1, choices=[0, 1, 2])
    ap.add_argument("--ahead", type=int, default=0,
                    help="prefetch layer + ahead's blocks (0: the blocks this layer's attention reads next)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    assert a.batch == 32, "overlap_gemm.c keeps 32 rows in registers"
    torch.set_num_threads(a.threads)
    kv_heads, group, head_dim, hidden, inter, bs = 3, 3, 64, 576, 1536, 16
    if not cpu_native.prepare(head_dim, group):
        raise SystemExit("overlap_prefetch: llmd's C kernel is unavailable here")
    lib = build()
    g = torch.Generator().manual_seed(0)
    lens = [a.context] * a.batch
    tables, slots, num_blocks = random_paged_layout(lens, bs, g)
    caches = []
    for _ in range(a.layers):
        c = PagedKVCache.allocate((2, num_blocks, bs, kv_heads, head_dim), get_format("auto"), torch.bfloat16, "cpu")
        c.data.normal_(generator=g)
        caches.append(c)
    spans = []  # per layer: K and V span of every block each sequence reads, in sequence order
    for c in caches:
        ps = []
        for b in range(a.batch):
            for blk in tables[b, : -(-a.context // bs)].tolist():
                ps += [c.data[0, blk].data_ptr(), c.data[1, blk].data_ptr()]
        spans.append((ctypes.c_void_p * len(ps))(*ps))
    span_bytes = bs * kv_heads * head_dim * 2
    shapes = [((9 + 2 * kv_heads) * head_dim, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    ws = [[torch.randn(n, k, generator=g).bfloat16() for n, k in shapes] for _ in range(a.layers)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, prepacked.BATCH_HINT) for w in lw] for lw in ws]
    own = [[pack_w(w) for w in lw] for lw in ws]
    xs = [torch.randn(a.batch, k, generator=g).bfloat16() for _, k in shapes]
    xps = [pack_x(x) for x in xs]
    yts = [torch.empty(n, 32) for n, _ in shapes]
    Ks = (ctypes.c_int * 4)(*[k for _, k in shapes])
    Ns = (ctypes.c_int * 4)(*[n for n, _ in shapes])
    xp_p, yt_p = ptrs(xps), ptrs(yts)
    own_p = [ptrs(lw) for lw in own]

    # correctness of the GEMM once
    lib.layer_gemms(4, xp_p, own_p[0], yt_p, Ks, Ns, None, 0, 0, 0, a.hint, a.threads)
    for x, w, yt in zip(xs, ws[0], yts):
        ref = x.double() @ w.double().t()
        err = ((yt.t().double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, err

    q = torch.randn(a.batch, kv_heads * group, head_dim, generator=g).bfloat16()
    meta = AttentionMetadata(torch.tensor([s[-1] for s in slots]), tables, torch.arange(a.batch + 1, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), [1] * a.batch, lens, bs, "cpu",
                             slots_padded=False, native_kernels=True)
    scale = head_dim**-0.5

    def linears(mode: str, layer: int) -> None:
        if mode == "onednn":
            for x, p in zip(xs, onednn[layer]):
                prepacked.linear(x, p)
        else:
            nxt = spans[(layer + a.ahead) % a.layers] if mode == "own+pf" else None
            lib.layer_gemms(4, xp_p, own_p[layer], yt_p, Ks, Ns, nxt, len(nxt) if nxt else 0, span_bytes,
                            a.per_iter, a.hint, a.threads)

    def run(lin: str | None, attn: bool) -> float:
        t0 = time.perf_counter()
        for layer in range(a.layers):
            if lin:
                linears(lin, layer)
            if attn:
                cpu_attention.paged_attention(q, caches[layer], meta, scale)
        return (time.perf_counter() - t0) * 1e3

    cases = {"onednn + attn": ("onednn", True), "own + attn": ("own", True), "own+pf + attn": ("own+pf", True),
             "onednn": ("onednn", False), "own": ("own", False), "own+pf": ("own+pf", False), "attn": (None, True)}
    for lin, attn in cases.values():
        run(lin, attn)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.rounds):
        for k, (lin, attn) in cases.items():
            times[k].append(run(lin, attn))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"overlap_prefetch: batch {a.batch} x {a.context}, {a.layers} layers, {a.threads} threads, per_iter "
          f"{a.per_iter}, hint t{a.hint}; ms per step, median of {a.rounds} alternating rounds")
    for k, v in med.items():
        print(f"  {k:<15} {v:7.2f}")
    print(f"  attention inside own+pf: {med['own+pf + attn'] - med['own+pf']:.2f} ms, inside own: "
          f"{med['own + attn'] - med['own']:.2f}, alone: {med['attn']:.2f}")
    print(f"  own+pf + attn / onednn + attn = {med['own+pf + attn'] / med['onednn + attn']:.3f}x")


if __name__ == "__main__":
    main()
