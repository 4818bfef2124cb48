"""Plain ``F.linear`` vs oneDNN-prepacked bfloat16 weights (:mod:`llmd.quant.prepacked`) vs the
tile-order kernel this CPU has (AMX tiles, :mod:`llmd.kernels.amx_linear`, or VDPBF16PS,
:mod:`llmd.kernels.dp_linear`; the column is left out where neither is), side by side in one run:
a model's layer matmuls (every 2-D weight of every decoder layer, fused Q/K/V and gate/up as the
model holds them) at several batch sizes, alternating the forms each round; ms for all of them,
median of the rounds. Random bfloat16 weights of the chosen model's shapes (SmolLM2-135M by
default: 30 layers, hidden 576, intermediate 1536).

    python benchmarks/prepacked_linear.py
    python benchmarks/prepacked_linear.py --rows 1,8,64,512 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from llmd.kernels import amx_linear, dp_linear
from llmd.quant import prepacked


def shapes(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """``(out, in)`` of one layer's weights: qkv, o, gate_up, down."""
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
            (hidden, inter)]


def ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,64,128,256,512")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(o, i, generator=g).bfloat16()
             for _ in range(args.layers)
             for o, i in shapes(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, prepacked.BATCH_HINT) for w in plain]
    tile = amx_linear if amx_linear.install() else dp_linear if dp_linear.install() else None
    tiles = [prepacked.tile_pack(w) for w in plain] if tile else []
    print(f"{len(plain)} bfloat16 weights ({sum(w.nbytes for w in plain) / 1e6:.0f} MB), {args.threads} threads; "
          f"ms for all of them, median of {args.rounds} alternating rounds"
          + (f"; tile = {prepacked.tile_kernel}" if tile else ""))
    print(f"{'rows':>5} {'F.linear':>9} {'prepacked':>10} {'ratio':>6}" + (f" {'tile':>7} {'tile/prepacked':>14}"
                                                                           if tile else ""))
    for m in map(int, args.rows.split(",")):
        xs = {i: torch.randn(m, i, generator=g).bfloat16() for i in {w.shape[1] for w in plain}}
        runs = {"plain": lambda: [F.linear(xs[w.shape[1]], w) for w in plain],
                "packed": lambda: [prepacked.linear(xs[w.shape[1]], p) for w, p in zip(plain, packed)]}
        if tile:
            runs["tile"] = lambda: [tile.linear(xs[w.shape[1]], p) for w, p in zip(plain, tiles)]
        for fn in runs.values():
            fn()
        t: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for k, fn in runs.items():
                t[k].append(ms(fn))
        a, b = statistics.median(t["plain"]), statistics.median(t["packed"])
        line = f"{m:>5} {a:>9.1f} {b:>10.1f} {b / a:>6.2f}"
        if tile:
            c = statistics.median(t["tile"])
            line += f" {c:>7.1f} {c / b:>14.2f}"
        print(line)


if __name__ == "__main__":
    main()
