"""The CPU KV pool is zeroed lazily: allocating it touches no pages, it reads as zeros, and only
the pages written become resident (``quant.kv.zeros``: an anonymous private memory map)."""

from __future__ import annotations

import torch

from llmd.quant.kv import PagedKVCache, get_format, zeros


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_pool_costs_no_memory_until_written():
    shape = (2, 1024, 16, 4, 64)  # 32 MiB of bfloat16
    before = resident_bytes()
    caches = [PagedKVCache.allocate(shape, get_format(kv), torch.bfloat16, "cpu") for kv in ("auto", "int8")]
    assert resident_bytes() - before < 8 * 2**20  # torch.zeros would make all 50 MiB resident at once
    auto, int8 = caches
    assert auto.data.shape == shape and auto.data.dtype == torch.bfloat16 and auto.data.is_contiguous()
    assert int8.data.dtype == torch.int8 and int8.scales.shape == shape[:-1] and int8.scales.dtype == torch.float32
    assert not auto.data.any() and not int8.data.any() and not int8.scales.any()  # reading pages: all zeros
    auto.data[0, 7] = 1.5
    assert auto.data[0, 7].eq(1.5).all() and auto.data.sum() == 1.5 * 16 * 4 * 64


def test_small_and_device_tensors_are_plain_zeros():
    t = zeros((4, 8), torch.float16, "cpu")
    assert t.dtype == torch.float16 and not t.any()
    assert zeros((2, 1024, 16, 4, 64), torch.float8_e4m3fn, "cpu").view(torch.uint8).sum() == 0
