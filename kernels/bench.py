"""``llmd bench kernels``: paged decode attention vs torch SDPA and a device copy (CUDA only).

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), block size 16,
random block tables, batch × context ∈ {64 × 4,096, 16 × 32,768}, one query token per
sequence. Per KV dtype (bf16, int8, fp8_e4m3, fp8_e5m2) it times the Triton split-KV decode
kernel; in the same run torch ``scaled_dot_product_attention(..., enable_gqa=True)`` on
contiguous bf16 K/V, fp8 → bf16 cast + SDPA, and a device-to-device copy of the bf16 KV
(bandwidth = bytes read + written). Achieved bandwidth = KV bytes read (scales included) /
time. Timing: ``triton.testing.do_bench`` (median of repeated runs, L2 flushed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmd.quant.kv import PagedKVCache, get_format

SHAPES = [(64, 4096), (16, 32768)]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _paged_cache(fmt_name: str, batch: int, ctx: int, gen: torch.Generator) -> tuple[PagedKVCache, torch.Tensor]:
    """A filled cache (K/V ~ N(0, 1) stored through store_kv) and a random block table ``[batch, ctx/16]``."""
    from llmd.kernels.kv_store import store_kv

    nblk = batch * ctx // BLOCK_SIZE
    fmt = get_format(fmt_name)
    cache = PagedKVCache.allocate((2, nblk + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), fmt, torch.bfloat16, "cuda")
    table = (torch.randperm(nblk, generator=gen, device="cuda") + 1).int().view(batch, -1)
    slots = torch.arange(nblk * BLOCK_SIZE, device="cuda") + BLOCK_SIZE
    for s in slots.split(1 << 20):
        kv = torch.randn(s.numel(), NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        store_kv(kv, kv, cache, s)
    return cache, table


def kv_bytes(cache: PagedKVCache, tokens: int) -> int:
    """Bytes a decode reads for ``tokens`` tokens: K and V data plus scales."""
    per_token = 2 * NUM_KV_HEADS * (HEAD_DIM * cache.data.element_size() + (4 if cache.scales is not None else 0))
    return per_token * tokens


def run_kernel_bench(echo: Callable[[str], None] = print, kv_dtypes=("auto", "int8", "fp8_e4m3", "fp8_e5m2"),
                     block_n: int = 64) -> list[dict]:
    """Time everything above; print one table per shape; return the rows (µs, TB/s)."""
    import triton

    from llmd.kernels.decode_attention import paged_decode_attention

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
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)  # noqa: E731
        dst = torch.empty_like(k)
        t_copy = triton.testing.do_bench(lambda: (dst.copy_(k), dst.copy_(v))) * 1e-3
        t_sdpa = triton.testing.do_bench(sdpa) * 1e-3
        k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        cast = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q4, k8.to(torch.bfloat16), v8.to(torch.bfloat16), enable_gqa=True)
        t_cast = triton.testing.do_bench(cast) * 1e-3
        del dst, k8, v8
        res = [("d2d copy (bf16 KV, read+write)", t_copy, 2 * bf16_bytes), ("torch SDPA bf16 contiguous", t_sdpa, bf16_bytes),
               ("fp8 -> bf16 cast + SDPA", t_cast, bf16_bytes // 2)]
        del k, v
        for name in kv_dtypes:
            cache, table = _paged_cache(name, batch, ctx, gen)
            fn = lambda: paged_decode_attention(q, cache, table, seq_lens, ctx, HEAD_DIM**-0.5, block_n=block_n)  # noqa: E731
            res.append((f"llmd paged decode {name if name != 'auto' else 'bf16'}", triton.testing.do_bench(fn) * 1e-3,
                        kv_bytes(cache, batch * ctx)))
            del cache, table
            torch.cuda.empty_cache()
        echo(f"\nbatch {batch} x context {ctx} (32 q heads, 8 KV heads, head_dim 128, block 16)")
        echo(f"{'op':<36}{'µs':>10}{'TB/s':>8}{'vs SDPA':>9}{'% copy BW':>11}")
        copy_bw = 2 * bf16_bytes / t_copy
        for name, t, nbytes in res:
            bw = nbytes / t
            echo(f"{name:<36}{t * 1e6:>10.1f}{bw / 1e12:>8.2f}{t_sdpa / t:>8.2f}x{100 * bw / copy_bw:>10.0f}%")
            rows.append({"batch": batch, "context": ctx, "op": name, "us": t * 1e6, "tb_s": bw / 1e12})
    return rows
