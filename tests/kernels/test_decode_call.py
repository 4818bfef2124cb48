"""``cpu_attention.decode_call``: a decode-only step's C kernel call bound once per step and KV
cache group (``cpu_native.DecodeCall``), which the bfloat16 glue forward calls per layer. It must
give the bits ``cpu_attention.paged_attention`` gives, and decline every step that function
would not send whole to the kernel."""

from __future__ import annotations

import pytest
import torch
from test_cpu_attention import make_step
from test_cpu_native import KEYS, _torch_path

from llmd.kernels import cpu_attention, cpu_native
from llmd.kernels.native import build

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"no native kernel: {build.why_not}")


@pytest.mark.parametrize("values", [("decode", 3, 16, 64, "auto", None, torch.bfloat16),
                                    ("spread", 4, 32, 128, "auto", 40, torch.float32),
                                    ("few", 3, 16, 64, "auto", None, torch.float32),
                                    ("spread", 1, 16, 64, "auto", 7, torch.bfloat16),
                                    ("decode", 3, 16, 64, "int8", None, torch.bfloat16),
                                    ("spread", 4, 16, 64, "fp8_e4m3", 40, torch.float32)],
                         ids=lambda v: "-".join(str(x) for x in v).replace("torch.", ""))
def test_bound_call_gives_the_dispatched_bits(values):
    case = dict(zip(KEYS, values))
    meta, query, cache = make_step(case, seed=11)
    q, heads, scale = query.to(case["dtype"]), query.shape[1], case["head_dim"] ** -0.5
    call = cpu_attention.decode_call(meta, cache, heads, q.dtype, scale, case["window"])
    assert isinstance(call, cpu_native.DecodeCall)
    assert cpu_attention.decode_call(meta, cache, heads, q.dtype, scale, case["window"]) is call  # once per step
    out = call(q, cache if cache.fmt.quantized else cache.data)
    expected = cpu_attention.paged_attention(q, cache, meta, scale, case["window"])
    assert out.dtype == q.dtype and torch.equal(out, expected) and out.abs().sum() > 0
    wide = torch.zeros(q.shape[0], heads + 2, q.shape[2], dtype=q.dtype)
    wide[:, :heads] = q  # a query row of its own stride (a slice of a wider projection)
    assert torch.equal(call(wide[:, :heads], cache), expected)
    with pytest.raises(ValueError, match="unlike the one"):
        call(q[:-1], cache)
    with pytest.raises(ValueError, match="unlike the one"):
        call(q.float() if q.dtype == torch.bfloat16 else q.bfloat16(), cache)
    if cache.fmt.quantized:
        with pytest.raises(ValueError, match="unlike the one"):
            call(q, cache.data)  # the codes without their scales


@pytest.mark.parametrize("values,why", [
    (("mixed", 3, 16, 64, "auto", None, torch.float32), "a prefill chunk in the step"),
    (("decode", 3, 16, 64, "int8", None, torch.float32), "grouped scales (--kv-scale-group-size)"),
    (("decode", 3, 16, 64, "auto", None, torch.float32), "the C kernels off (--disable-native-kernels)"),
])
def test_steps_the_kernel_does_not_take_whole_get_none(values, why):
    case = dict(zip(KEYS, values), scale_group=32 if "grouped" in why else 0)
    meta, query, cache = make_step(case, seed=12)
    if "off" in why:
        meta = _torch_path(meta)
    assert cpu_attention.decode_call(meta, cache, query.shape[1], torch.float32, 0.125) is None, why
