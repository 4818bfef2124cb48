"""The CPU KV pool is zeroed lazily: allocating it touches no pages, it reads as zeros, and only
the pages written become resident (``quant.kv.zeros``: an anonymous private memory map); its K and
V planes are skewed by 2 KiB modulo the page (``quant.kv.kv_planes``)."""

from __future__ import annotations

import math

import pytest
import torch

from llmd.quant.kv import PLANE_SKEW_BYTES, PagedKVCache, get_format, kv_planes, plane_stride, planes_contiguous, zeros


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_pool_costs_no_memory_until_written():
    shape = (2, 1024, 16, 4, 64)  # 32 MiB of bfloat16
    before = resident_bytes()
    caches = [PagedKVCache.allocate(shape, get_format(kv), torch.bfloat16, "cpu") for kv in ("auto", "int8")]
    assert resident_bytes() - before < 8 * 2**20  # torch.zeros would make all 50 MiB resident at once
    auto, int8 = caches
    assert auto.data.shape == shape and auto.data.dtype == torch.bfloat16 and planes_contiguous(auto.data)
    assert int8.data.dtype == torch.int8 and int8.scales.shape == shape[:-1] and int8.scales.dtype == torch.float32
    assert not auto.data.any() and not int8.data.any() and not int8.scales.any()  # reading pages: all zeros
    auto.data[0, 7] = 1.5
    assert auto.data[0, 7].eq(1.5).all() and auto.data.sum() == 1.5 * 16 * 4 * 64


def test_small_and_device_tensors_are_plain_zeros():
    t = zeros((4, 8), torch.float16, "cpu")
    assert t.dtype == torch.float16 and not t.any()
    assert zeros((2, 1024, 16, 4, 64), torch.float8_e4m3fn, "cpu").view(torch.uint8).sum() == 0


@pytest.mark.parametrize("shape,dtype", [((2, 1058, 16, 3, 64), torch.bfloat16), ((2, 64, 16, 1, 256), torch.bfloat16),
                                         ((2, 1000, 16, 8, 128), torch.float32), ((2, 999, 16, 3, 64), torch.int8),
                                         ((2, 77, 32, 3), torch.float32), ((2, 5, 16, 2, 64), torch.float64)])
def test_cpu_planes_start_2_kib_past_a_page_apart(shape, dtype):
    """kv_planes: each plane contiguous, V plane ≡ 2 KiB mod 4 KiB from K (a gap < 4 KiB), zeros
    (lazily mapped or not), writes through the view land in the right plane; on another device
    the tensor stays contiguous."""
    t = kv_planes(shape, dtype, "cpu")
    plane = math.prod(shape[1:])
    assert t.shape == shape and t.dtype == dtype and planes_contiguous(t)
    assert t.stride(0) * dtype.itemsize % 4096 == PLANE_SKEW_BYTES and 0 <= t.stride(0) - plane < 4096 // dtype.itemsize
    assert not t.any()
    t[1, -1] = 3
    assert t[0].sum() == 0 and t[1].sum() == 3 * math.prod(shape[2:])
    assert plane_stride(shape, dtype, "meta") == plane and kv_planes(shape, dtype, "meta").is_contiguous()
    with pytest.raises(ValueError, match="2 planes"):
        kv_planes((3, *shape[1:]), dtype, "cpu")

