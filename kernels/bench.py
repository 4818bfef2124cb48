"""``llmd bench kernels``: paged decode attention vs torch SDPA and a device copy (CUDA only).

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), block size 16,
random block tables, batch × context ∈ {64 × 4,096, 16 × 32,768}, one query token per
sequence. Per KV dtype (bf16, int8, fp8_e4m3, fp8_e5m2) it times the Triton split-KV decode
kernel; in the same run torch ``scaled_dot_product_attention(..., enable_gqa=True)`` on
contiguous bf16 K/V, fp8 → bf16 cast + SDPA, and a device-to-device copy of the bf16 KV
(bandwidth = bytes read + written). Achieved bandwidth = KV bytes read (scales included) /
time. Timing: ``triton.testing.do_bench`` (median of repeated runs, L2 flushed). The decode
kernel runs at the engine's own tile (``DECODE_BLOCK_N``) and split count; SDPA is pinned to one
backend (flash, else efficient, cuDNN, math: the first that runs this shape) and named in its row.

:func:`run_kernel_check` is the correctness check the GPU script runs first: every kernel on
CUDA vs the float64 reference over a pairwise covering set (model dtype × KV dtype × head_dim
× GQA group × block size × window × path), torch + triton only (no pytest, no model files);
int4 cases run the KIVI store and kernels (:mod:`llmd.kernels.kivi_check`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import torch

from llmd.kernels.launch import DECODE_BLOCK_N
from llmd.quant.kv import PagedKVCache, get_format

SHAPES = [(64, 4096), (16, 32768)]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _paged_cache(fmt_name: str, batch: int, ctx: int, gen: torch.Generator) -> tuple[PagedKVCache, torch.Tensor]:
    """A filled cache (K/V ~ N(0, 1) stored through store_kv) and a random block table ``[batch, ctx/16]``."""
    from llmd.kernels import kivi
    from llmd.kernels.kv_store import store_kv

    nblk = batch * ctx // BLOCK_SIZE
    fmt = get_format(fmt_name)
    cache = PagedKVCache.allocate((2, nblk + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), fmt, torch.bfloat16, "cuda",
                                  residual_slots=batch)
    table = (torch.randperm(nblk, generator=gen, device="cuda") + 1).int().view(batch, -1)
    slots = torch.arange(nblk * BLOCK_SIZE, device="cuda") + BLOCK_SIZE
    for s in slots.split(1 << 20):
        kv = torch.randn(s.numel(), NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        if fmt.k_per_block:  # int4: V per token, K per full block (every block is full here)
            kivi.store_values(kv, cache, s)
            kivi._write_blocks(cache, s[::BLOCK_SIZE] // BLOCK_SIZE, kv.view(-1, BLOCK_SIZE, *kv.shape[1:]))
        else:
            store_kv(kv, kv, cache, s)
    return cache, table


def kv_bytes(cache: PagedKVCache, tokens: int) -> int:
    """Bytes a decode reads for ``tokens`` tokens: K and V data plus scales (int4: codes, K's
    per-block scale and zero point, V's per-token group scales; the residual's last block aside)."""
    if cache.fmt.k_per_block:
        return int(2 * NUM_KV_HEADS * cache.fmt.head_bytes(HEAD_DIM, "bfloat16", BLOCK_SIZE) * tokens)
    per_token = 2 * NUM_KV_HEADS * (HEAD_DIM * cache.data.element_size() + (4 if cache.scales is not None else 0))
    return per_token * tokens


def _decode_fn(q, cache, table, seq_lens, ctx: int, block_n: int):
    """The timed decode: the int8/fp8/16-bit kernel, or int4's KIVI kernel (own block from the residual)."""
    from llmd.kernels.decode_attention import paged_decode_attention

    if not cache.fmt.k_per_block:
        return lambda: paged_decode_attention(q, cache, table, seq_lens, ctx, HEAD_DIM**-0.5, block_n=block_n)
    from llmd.kernels.kivi_decode import kivi_paged_decode_attention

    own = cache.residual.view(-1, *cache.residual.shape[2:])
    rows = torch.arange(q.shape[0], dtype=torch.int64, device=q.device) * BLOCK_SIZE
    return lambda: kivi_paged_decode_attention(q, cache, table, seq_lens, own, rows, ctx, HEAD_DIM**-0.5)


def _sdpa(backend, q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def _sdpa_backend(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The SDPA backend the bench pins: the first of flash, efficient, cuDNN, math that runs this shape."""
    from torch.nn.attention import SDPBackend

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            _sdpa(backend, q4, k, v)
            torch.cuda.synchronize()
            return backend
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend runs this shape")


def run_kernel_bench(echo: Callable[[str], None] = print, kv_dtypes=("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4"),
                     block_n: int = DECODE_BLOCK_N) -> list[dict]:
    """Time everything above; print one table per shape; return the rows (µs, TB/s)."""
    import triton


    if not torch.cuda.is_available():
        raise RuntimeError("llmd bench kernels needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, ctx in SHAPES:
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        k = torch.randn(batch, NUM_KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        bf16_bytes = 2 * k.numel() * 2
        q4 = q[:, :, None, :]
        backend = _sdpa_backend(q4, k, v)
        sdpa_name = backend.name.lower()
        dst = torch.empty_like(k)
        t_copy = triton.testing.do_bench(lambda: (dst.copy_(k), dst.copy_(v))) * 1e-3
        t_sdpa = triton.testing.do_bench(lambda: _sdpa(backend, q4, k, v)) * 1e-3
        k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        t_cast = triton.testing.do_bench(
            lambda: _sdpa(backend, q4, k8.to(torch.bfloat16), v8.to(torch.bfloat16))) * 1e-3
        del dst, k8, v8
        res = [("d2d copy (bf16 KV, read+write)", t_copy, 2 * bf16_bytes),
               (f"torch SDPA bf16 contiguous ({sdpa_name})", t_sdpa, bf16_bytes),
               (f"fp8 -> bf16 cast + SDPA ({sdpa_name})", t_cast, bf16_bytes // 2)]
        del k, v
        for name in kv_dtypes:
            cache, table = _paged_cache(name, batch, ctx, gen)
            fn = _decode_fn(q, cache, table, seq_lens, ctx, block_n)
            res.append((f"llmd paged decode {name if name != 'auto' else 'bf16'}", triton.testing.do_bench(fn) * 1e-3,
                        kv_bytes(cache, batch * ctx)))
            del cache, table
            torch.cuda.empty_cache()
        echo(f"\nbatch {batch} x context {ctx} (32 q heads, 8 KV heads, head_dim 128, block 16, "
             f"decode BLOCK_N {block_n})")
        echo(f"{'op':<44}{'µs':>10}{'TB/s':>8}{'vs SDPA':>9}{'% copy BW':>11}")
        copy_bw = 2 * bf16_bytes / t_copy
        for name, t, nbytes in res:
            bw = nbytes / t
            echo(f"{name:<44}{t * 1e6:>10.1f}{bw / 1e12:>8.2f}{t_sdpa / t:>8.2f}x{100 * bw / copy_bw:>10.0f}%")
            rows.append({"batch": batch, "context": ctx, "op": name, "us": t * 1e6, "tb_s": bw / 1e12})
    return rows


#: Dimensions of the CUDA correctness check (``run_kernel_check``).
CHECK_DIMS = {
    "dtype": ["bfloat16", "float16", "float32"], "kv": ["auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4"],
    "head_dim": [64, 128, 256], "group": [1, 3, 4, 8], "block_size": [16, 32], "window": [None, 40],
    "path": ["decode", "split", "prefill"],
}
#: ‖kernel − float64 reference on the same stored bytes‖ / ‖reference‖, per model dtype (the
#: query, K/V and output are rounded to it; probabilities enter the dot in it).
CHECK_BUDGET = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 1.5e-2}


def check_cases(rows: int = 36, seed: int = 0) -> list[dict]:
    """``rows`` random cases of :data:`CHECK_DIMS` in which every value of every dimension appears,
    plus one more random case for each (KV dtype, path) pair they miss (each format has its own
    decode, split and prefill kernels)."""
    rng = random.Random(seed)
    cases = [{k: rng.choice(v) for k, v in CHECK_DIMS.items()} for _ in range(rows)]
    for i, (k, v) in enumerate((k, x) for k, vals in CHECK_DIMS.items() for x in vals):
        if not any(c[k] == v for c in cases):
            cases[i % rows][k] = v
    for kv, path in itertools.product(CHECK_DIMS["kv"], CHECK_DIMS["path"]):
        if not any(c["kv"] == kv and c["path"] == path for c in cases):
            cases.append({k: rng.choice(v) for k, v in CHECK_DIMS.items()} | {"kv": kv, "path": path})
    return cases


def random_paged_layout(seq_lens: list[int], block_size: int, gen: torch.Generator, spare_blocks: int = 3,
                        spare_columns: int = 1) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Sequences scattered over a shuffled pool of KV blocks (block 0, the null block, unused).

    Args:
        seq_lens: tokens per sequence.
        spare_blocks: blocks in the pool beyond those the sequences need; spare_columns: 0-padded
            block-table columns beyond the longest sequence's blocks.
    Returns:
        ``(block_tables [B, max_blocks + spare_columns] int32, slots, num_blocks)``: ``slots[b]``
        ``[seq_lens[b]]`` int64 is the slot of each of sequence ``b``'s positions.
    """
    nblocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblocks) + spare_blocks
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(seq_lens), max(nblocks) + spare_columns, dtype=torch.int32)
    slots, used = [], 0
    for b, (s, n) in enumerate(zip(seq_lens, nblocks)):
        tables[b, :n] = perm[used : used + n]
        used += n
        pos = torch.arange(s)
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    return tables, slots, num_blocks


def _check_case(case: dict, gen: torch.Generator, dev: str = "cuda") -> tuple[float, bool]:
    """(relative error vs float64, store_kv bytes equal to the torch reference's) of one case on
    ``dev`` (CUDA; "cpu" under ``TRITON_INTERPRET=1`` to test this check itself)."""
    from llmd.kernels import AttentionMetadata, reference
    from llmd.kernels.decode_attention import paged_decode_attention
    from llmd.kernels.kv_store import store_kv
    from llmd.kernels.prefill_attention import paged_prefill_attention

    dt, fmt, hd, bs = getattr(torch, case["dtype"]), get_format(case["kv"]), case["head_dim"], case["block_size"]
    nkv = 2 if hd < 256 else 1
    decode = case["path"] != "prefill"
    ctx_q = [(0, 1), (37, 1), (300, 1), (bs - 1, 1)] if decode else [(0, 33), (45, 17), (130, 1), (200, 50)]
    seq_lens = [c + q for c, q in ctx_q]
    tables, slots, num_blocks = random_paged_layout(seq_lens, bs, gen)
    slot = torch.cat(slots)
    k = torch.randn(len(slot), nkv, hd, generator=gen).to(dt)
    v = torch.randn(len(slot), nkv, hd, generator=gen).to(dt)
    qlens = [q for _, q in ctx_q]
    q = torch.randn(sum(qlens), nkv * case["group"], hd, generator=gen).to(dt)
    if fmt.k_per_block:
        from llmd.kernels.kivi_check import check_int4_case

        return check_int4_case(case, ctx_q, tables, slots, num_blocks, k, v, q, dev)
    shape = (2, num_blocks, bs, nkv, hd)
    cache, ref_cache = PagedKVCache.allocate(shape, fmt, dt, dev), PagedKVCache.allocate(shape, fmt, dt, "cpu")
    store_kv(k.to(dev), v.to(dev), cache, slot.to(dev))
    reference.store_kv(k, v, ref_cache, slot)
    exact = torch.equal(cache.data.cpu().view(torch.uint8), ref_cache.data.view(torch.uint8))
    if fmt.quantized:
        exact = exact and torch.equal(cache.scales.cpu(), ref_cache.scales)
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    scale, window = hd**-0.5, case["window"]
    if decode:
        out = paged_decode_attention(q.to(dev), cache, tables.to(dev), sl.to(dev), max(seq_lens), scale, window,
                                     num_splits=1 if case["path"] == "decode" else 4)
    else:
        out = paged_prefill_attention(q.to(dev), cache, tables.to(dev), qsl.to(dev), sl.to(dev), max(qlens), scale,
                                      window)
    meta = AttentionMetadata(slot, tables, qsl, sl, qlens, seq_lens, bs, "torch")
    ref = reference.paged_attention(q.double(), ref_cache, meta, scale, window, compute_dtype=torch.float64)
    out = out.cpu().double()
    err = ((out - ref).norm() / ref.norm()).item() if torch.isfinite(out).all() else float("inf")
    return err, exact


def run_kernel_check(echo: Callable[[str], None] = print, rows: int = 36, dev: str = "cuda") -> int:
    """store_kv, decode (direct and split + merge) and prefill on CUDA vs the float64 reference on
    the same stored bytes, and store_kv's bytes vs the torch reference's (bit for bit). One line
    per case; returns the number of failures."""
    if dev == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the kernel check needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    failures = 0
    cases = check_cases(rows)
    for case in cases:
        try:
            err, exact = _check_case(case, gen, dev)
            budget = CHECK_BUDGET[case["dtype"]]
            ok = exact and err <= budget
            line = f"rel {err:.2e} (budget {budget:.0e}), store_kv bytes {'equal' if exact else 'DIFFER'}"
        except Exception as e:  # noqa: BLE001 (one failing variant must not hide the others)
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1:] or [""]  # compile errors end with the cause
            ok, line = False, f"{type(e).__name__}: {last[0][:300]}"
        failures += not ok
        echo(f"{'ok  ' if ok else 'FAIL'} {case}  {line}")
    echo(f"kernel check: {len(cases) - failures}/{len(cases)} cases ok")
    return failures


if __name__ == "__main__":  # the GPU script's entry points (no click CLI needed)
    import sys

    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    if what == "check":
        sys.exit(1 if run_kernel_check() else 0)
    run_kernel_bench()
