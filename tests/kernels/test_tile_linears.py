"""bfloat16 linears over tile-order packs: on AMX tiles (kernels/amx_linear.py,
kernels/native/amx_linear.c) and by VDPBF16PS (kernels/dp_linear.py, kernels/native/dp_linear.c),
each against the float64 product and ``F.linear``; the packing; how ``prepack_model`` chooses the
tile order or oneDNN. Each test runs once per kernel this CPU has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmd.kernels import amx_linear, dp_linear
from llmd.quant import prepacked

KERNELS = {"amx": amx_linear, "dp": dp_linear}


@pytest.fixture(params=list(KERNELS))
def kernel(request, monkeypatch):
    """The kernel module, installed as the model runner installs it (restored afterwards)."""
    mod = KERNELS[request.param]
    if not mod.available():
        pytest.skip(f"no {request.param} linear kernel on this CPU (or its LLMD_*_LINEAR switch is 0)")
    monkeypatch.setattr(prepacked, "tile_linear", prepacked.tile_linear)
    for name in ("tile_kernel", "tile_pack", "tile_unpack"):
        monkeypatch.setattr(prepacked, name, getattr(prepacked, name))
    assert mod.install()
    return mod


ROWS = (1, 2, 15, 16, 17, 31, 32, 33, 63, 100, 257, 512)


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """One bfloat16 unit in the last place of each element of ``t`` (float64)."""
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64), torch.frexp(t.double()).exponent - 8)


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (64, 32), (3072, 576)])
def test_rows_match_float64_and_f_linear_and_not_the_batch(kernel, n, k):
    """Every row count from 1 to a prefill chunk: within a bfloat16 rounding (plus float32
    summation error) of the float64 product, as ``F.linear`` is, ≥ 99.9 % of the elements equal to
    ``F.linear``'s (all of them where oneDNN blocks alike), and each row equal to the same row
    computed in any other call (batch invariance)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    p = prepacked.tile_pack(w)
    assert prepacked.is_amx(p) and p.shape == (n, k) and torch.equal(prepacked.dense(p), w)
    x = torch.randn(max(ROWS), k, generator=g).bfloat16()
    full = kernel.linear(x, p)
    exact = x.double() @ w.double().T
    # one bfloat16 rounding of the result plus float32 summation error (2^-20 of the |terms|' sum)
    bound = _ulp(exact) + 2.0**-20 * (x.double().abs() @ w.double().abs().T)
    assert ((full.double() - exact).abs() <= bound).all()
    for m in ROWS:
        y = prepacked.linear(x[:m], p)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert torch.equal(y, full[:m]), m  # batch-invariant rows
        ref = F.linear(x[:m], w)
        assert ((ref.double() - exact[:m]).abs() <= bound[:m]).all(), m  # the bound holds for oneDNN too
        assert (y == ref).double().mean() >= 0.999, m  # and nearly every element is its very bits


def test_strided_and_batched_inputs_and_other_dtypes(kernel):
    """A strided view, a 3-D input and a float32 input (computed in bfloat16, returned float32)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g).bfloat16()
    p = prepacked.tile_pack(w)
    wide = torch.randn(7, 192, generator=g).bfloat16()[:, ::2]
    assert torch.equal(kernel.linear(wide, p), kernel.linear(wide.contiguous(), p))
    rows = torch.randn(5, 200, generator=g).bfloat16()[:, :96]  # rows with a longer stride, no copy
    assert torch.equal(kernel.linear(rows, p), kernel.linear(rows.contiguous(), p))
    x3 = torch.randn(2, 3, 96, generator=g).bfloat16()
    assert torch.equal(kernel.linear(x3, p), kernel.linear(x3.reshape(6, 96), p).view(2, 3, 64))
    xf = torch.randn(4, 96, generator=g)
    y = kernel.linear(xf, p)
    assert y.dtype == torch.float32 and torch.equal(y, kernel.linear(xf.bfloat16(), p).float())
    assert kernel.linear(torch.empty(0, 96, dtype=torch.bfloat16), p).shape == (0, 64)


def test_an_input_of_other_in_features_is_refused(kernel):
    """x's last size must be the weight's K, as for ``F.linear``: a shorter 2-D row was read past
    its end (K elements at the row's stride) and a longer one cut to K, without an error."""
    p = prepacked.tile_pack(torch.randn(64, 96).bfloat16())
    for shape in ((3, 64), (5, 128), (2, 2, 48)):
        with pytest.raises(RuntimeError, match="in-features 96"):
            kernel.linear(torch.randn(*shape).bfloat16(), p)


def test_a_model_that_does_not_want_the_kernel_keeps_onednn_after_another_installed_it(kernel, tmp_path,
                                                                                        monkeypatch):
    """The install is process-wide and stays: a later runner whose model does not want VDPBF16PS
    (``dp_linear.wanted`` false: ``--weight-quant auto``) packs its weights for oneDNN. It took
    the kernel an earlier engine had installed (order-dependent: ``llmd bench single --formats
    none,gguf`` ran gguf's batches on VDPBF16PS, ``gguf,none`` on oneDNN)."""
    if kernel is not dp_linear:
        pytest.skip("the AMX kernel is installed for every bfloat16 model")
    from tiny_engine import tiny_engine

    from llmd.daemon.core.model_runner import ModelRunner
    from llmd.models.gguf_loader import load_model

    monkeypatch.delenv("LLMD_DP_LINEAR", raising=False)
    tiny_engine(tmp_path / "t.gguf")
    model, _ = load_model(str(tmp_path / "t.gguf"), torch.bfloat16, "cpu", weight_quant="gguf", keep_dense=True)
    assert not dp_linear.wanted(model) and prepacked.tile_linear is not None  # installed by the fixture
    runner = ModelRunner(model, 8, 16, torch.bfloat16, "cpu", attention_backend="cpu")
    assert runner.prepacked_linears > 0 and prepacked.amx_count(model) == 0


def test_prepack_model_packs_tile_order_where_the_shape_fits_else_onednn(kernel):
    """With a kernel installed, 32-multiple weights become tile-order packs and the rest oneDNN's;
    :func:`unpack_model` gives every weight back bit for bit."""
    from llmd.models.layers import linear

    layer = torch.nn.Module()
    layer.fits = linear(64, 96, torch.bfloat16)
    layer.odd = linear(24, 40, torch.bfloat16)
    with torch.no_grad():
        for m in (layer.fits, layer.odd):
            m.weight.normal_()
    plain = {name: m.weight.detach().clone() for name, m in (("fits", layer.fits), ("odd", layer.odd))}
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    x = torch.randn(3, 64).bfloat16()
    want = layer.fits(x)
    assert prepacked.prepack_model(model) == 2
    assert prepacked.is_amx(layer.fits.weight) and layer.odd.weight.is_mkldnn and prepacked.amx_count(model) == 1
    assert torch.equal(layer.fits(x), want)  # 3 rows: oneDNN and the kernels agree here
    assert prepacked.unpack_model(model) == 2
    assert torch.equal(layer.fits.weight, plain["fits"]) and torch.equal(layer.odd.weight, plain["odd"])


@pytest.mark.parametrize("name,switch", [("amx", "LLMD_AMX_LINEAR"), ("dp", "LLMD_DP_LINEAR")])
def test_the_switch_turns_it_off(monkeypatch, name, switch):
    monkeypatch.setenv(switch, "0")
    assert not KERNELS[name].available()


def test_the_runner_wants_vdpbf16ps_only_where_small_steps_run_dense_weights(monkeypatch):
    """``dp_linear.wanted``: a model without quantized small-step weights (``--weight-quant none``)
    gets the kernel; one with a ``PackedLinear`` (``auto``: steps of <= 4 rows run int4/int8) keeps
    oneDNN; ``LLMD_DP_LINEAR=1`` installs it anyway."""
    from llmd.quant.packed_linear import PackedLinear

    class Quantized(torch.nn.Module):  # a PackedLinear found among the modules, built without its packs
        def __init__(self):
            super().__init__()
            self.proj = PackedLinear.__new__(PackedLinear)
            torch.nn.Module.__init__(self.proj)

    monkeypatch.delenv("LLMD_DP_LINEAR", raising=False)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 32))
    assert dp_linear.wanted(plain) and not dp_linear.wanted(Quantized())
    monkeypatch.setenv("LLMD_DP_LINEAR", "1")
    assert dp_linear.wanted(Quantized())
