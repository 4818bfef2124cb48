"""bitsandbytes layers (``llmd.quant.bnb_linear``) against references written from the papers:
NF4 codes are the nearest of QLoRA's 16 values to ``w / absmax`` per block of 64, the 4-bit
layers (both layouts, nf4 and fp4) equal a float64 matmul of their dequantized weight, the int8
layer equals LLM.int8()'s decomposition computed here in float64; the import fetches nothing
and prints nothing."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from llmd.quant.bnb import import_bitsandbytes
from llmd.quant.bnb_linear import BLOCKSIZE, INT8_THRESHOLD, BnbLinear, layout_for, quantize_4bit, quantize_int8

# QLoRA (Dettmers et al. 2023), appendix E: the NF4 data type's 16 values
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0])


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _codes(packed: torch.Tensor) -> np.ndarray:
    """4-bit codes of bitsandbytes' plain layout ``[N·K/2, 1]``, high nibble first (row-major [N, K])."""
    p = packed.numpy()[:, 0]
    return np.stack([p >> 4, p & 15], axis=1).reshape(-1)


def _reference_weight(w: torch.Tensor, kind: str, layout: str) -> torch.Tensor:
    """``table[code] · absmax`` per block of 64 from the plain quantization of ``w``, in float64
    (the CPU layout holds the same codes and the absmax rounded to bfloat16)."""
    packed, absmax = quantize_4bit(w, kind, "plain")
    fp4 = import_bitsandbytes().functional.get_4bit_type("fp4", device="cpu")
    table = NF4 if kind == "nf4" else fp4.double().numpy()
    if layout == "cpu":
        absmax = absmax.bfloat16().float()
    vals = table[_codes(packed)].reshape(-1, BLOCKSIZE) * absmax.double().numpy()[:, None]
    return torch.from_numpy(vals.reshape(w.shape))


def test_nf4_codes_are_the_nearest_qlora_values_per_block():
    w = _weight(64, 128)
    packed, absmax = quantize_4bit(w, "nf4", "plain")
    assert packed.shape == (64 * 128 // 2, 1) and absmax.shape == (64 * 128 // BLOCKSIZE,)
    assert absmax.dtype == torch.float32
    codes = _codes(packed)
    blocks = w.numpy().reshape(-1, BLOCKSIZE)
    np.testing.assert_allclose(absmax.numpy(), np.abs(blocks).max(axis=1), rtol=1e-6)
    x = (blocks / np.abs(blocks).max(axis=1, keepdims=True)).reshape(-1)
    err = np.abs(x - NF4[codes])
    best = np.abs(x[:, None] - NF4[None, :]).min(axis=1)
    assert np.all(err <= best + 1e-6)  # each weight took the nearest value (ties either way)


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype,layout", [(torch.float32, "plain"), (torch.bfloat16, "plain"),
                                          (torch.bfloat16, "cpu")])
def test_4bit_layer_equals_a_float64_matmul_of_its_weight(kind, dtype, layout):
    if layout == "cpu" and layout_for(96, 192, torch.bfloat16, "cpu") != "cpu":
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes has no CPU layout here")
    n, k = 96, 192
    w = _weight(n, k)
    layer = BnbLinear(k, n, kind, *quantize_4bit(w, kind, layout), layout)
    wq = _reference_weight(w, kind, layout)
    assert (wq - w.double()).abs().max() < 0.2 * w.abs().max()  # a 4-bit copy of w
    for shape in ((1, k), (32, k), (2, 5, k)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (*shape[:-1], n)
        ref = x.double() @ wq.t()
        # float32: the dequantized weight is exact; bfloat16: bf16 weights (and, in the CPU layout, absmax)
        # and bf16 output rounding
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (y.double() - ref).abs().max() <= tol * ref.abs().max(), (y.double() - ref).abs().max()


def test_cpu_layout_needs_tiles_of_32_rows_and_blocks_of_64():
    assert layout_for(96, 190, torch.bfloat16, "cpu") == "plain"
    assert layout_for(80, 192, torch.bfloat16, "cpu") == "plain"
    assert layout_for(96, 192, torch.float32, "cpu") == "plain"
    assert layout_for(96, 192, torch.bfloat16, "cuda") == "plain"


def _llm_int8_reference(x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """LLM.int8() (Dettmers et al. 2022, section 3.2) in float64: columns of ``x`` holding a value
    of magnitude >= 6 multiply the dequantized weight unquantized; the rest is quantized per row to
    int8 (absmax / 127) and multiplied by the int8 codes, then scaled by both absmaxes."""
    x = x.double()
    outliers = (x.abs() >= INT8_THRESHOLD).any(dim=0)
    w = cb.double() * scb.double()[:, None] / 127
    rest = torch.where(outliers, 0.0, x)
    row_max = rest.abs().amax(dim=1, keepdim=True)
    xq = torch.round(rest * 127 / row_max)
    return x[:, outliers] @ w[:, outliers].t() + (xq @ cb.double().t()) * row_max * scb.double() / 127**2


@pytest.mark.parametrize("outlier", [0.0, 20.0])
def test_int8_layer_is_llm_int8(outlier):
    n, k = 48, 128
    w = _weight(n, k, seed=3)
    cb, scb = quantize_int8(w.numpy())
    np.testing.assert_array_equal(cb.numpy(), np.round(127 * w.numpy() / np.abs(w.numpy()).max(1, keepdims=True)))
    layer = BnbLinear(k, n, "int8", cb, scb)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(4))
    x[:, 7] += outlier  # one outlier column: kept in float16 by the decomposition
    for dtype in (torch.float32, torch.bfloat16):
        y = layer(x.to(dtype))
        ref = _llm_int8_reference(x.to(dtype).to(torch.float16), cb, scb)
        assert y.dtype == dtype
        # float16 activations / output and the bf16 output rounding; the int8 products are exact
        tol = 2e-3 if dtype == torch.float32 else 1e-2
        assert (y.double() - ref).abs().max() <= tol * ref.abs().max(), (y.double() - ref).abs().max()
    if outlier:  # without the split, int8 rows scaled by 20 would be far off
        plain = x.double() @ (cb.double() * scb.double()[:, None] / 127).t()
        assert (layer(x).double() - plain).abs().max() < 5e-3 * plain.abs().max()


IMPORT_QUIETLY = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING)  # a handler that would print the hub warning
import torch
from llmd.quant.bnb import import_bitsandbytes
had = "kernels" in sys.modules
bnb = import_bitsandbytes()
print("KERNELS", had, "kernels" in sys.modules, "BNB", bnb.__version__)
"""


def test_import_fetches_no_kernels_package_and_prints_nothing():
    """In the repository root (where ``kernels`` is llmd's own folder) and with a logging handler
    installed, the import prints no warning and leaves ``sys.modules['kernels']`` as it was."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", IMPORT_QUIETLY], capture_output=True, text=True, timeout=120, cwd=root,
                       env={**os.environ, "HF_HUB_OFFLINE": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "KERNELS False False BNB 0.50.2", r.stdout
    assert "kernels" not in r.stderr.lower() and "warning" not in r.stderr.lower(), r.stderr
