"""Dense bfloat16 linears by VDPBF16PS (``kernels/native/dp_linear.c``), the CPU's layer matmuls
where AVX512-BF16 is there and the AMX tile kernel (:mod:`llmd.kernels.amx_linear`) is not: AMD Zen 4
and later, Intel Cooper Lake.

Its weights are :func:`llmd.quant.prepacked.dp_pack` packs (the same bytes as the plain weight, no
second copy). Installed by the model runner on a bfloat16 CPU model when
:func:`llmd.kernels.amx_linear.install` is not; :func:`llmd.quant.prepacked.prepack_model` then
packs every weight whose sizes are multiples of 32 so, and :func:`llmd.quant.prepacked.linear` runs
them here. Why: at 1-4 rows it streams the weights at ~24 GB/s where oneDNN's brgemm reads ~14 on
the 2-core Zen 4 (SmolLM2's 120 layer matmuls 8.8-9.0 ms against 12.1-17.3), and above 4 rows it is
level with oneDNN (0.86-1.12x by shape): README, "bfloat16 linears by VDPBF16PS";
``python benchmarks/prepacked_linear.py`` prints both side by side.

Numerics: exact bfloat16 products summed in float32 in input order, rounded once to bfloat16: within
a bfloat16 rounding of the float64 product, ≥ 99.9 % of elements equal to ``F.linear``'s, and a
row's output never depends on the other rows of the call (``tests/kernels/test_tile_linears.py``).
The model runner installs it only where steps of at most 4 rows run dense weights (:func:`wanted`);
``LLMD_DP_LINEAR=0`` keeps oneDNN's packs, ``1`` installs it for every bfloat16 model (the A/B switch).
"""

from __future__ import annotations

import os

import torch

from llmd.kernels.amx_linear import product
from llmd.kernels.native import build
from llmd.quant import prepacked


def available() -> bool:
    """The library is built with AVX512-BF16 and ``LLMD_DP_LINEAR`` is not ``0``."""
    if os.environ.get("LLMD_DP_LINEAR", "1") == "0":
        return False
    lib = build.load_dp_linear()
    return lib is not None and lib.llmd_dp_linear_ready() == 1


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ W.T`` → ``[..., N]`` in x's dtype (computed in bfloat16), for ``w`` =
    :func:`llmd.quant.prepacked.dp_pack` of a bfloat16 ``W [N, K]``.

    Raises:
        RuntimeError: the kernel refused the call (K or N not a multiple of 32, which
            :func:`llmd.quant.prepacked.amx_packable` keeps out, or a build without AVX512-BF16).
    """
    return product(build.load_dp_linear().llmd_dp_linear, "dp_linear", x, w)


def wanted(model: torch.nn.Module) -> bool:
    """Whether the model runner should install the kernel for ``model``: when its small steps run
    the dense weights too (no layer is a :class:`llmd.quant.packed_linear.PackedLinear`, i.e.
    ``--weight-quant none``), where it measured 1.2-2x oneDNN at 1-4 rows and +14 % output tok/s at
    ``--max-num-seqs 4``; not where steps of <= 4 rows run quantized weights (``--weight-quant auto``,
    the default), since above 4 rows it is level with oneDNN (0.86-1.12x by shape). ``LLMD_DP_LINEAR=1``
    installs it anyway (the A/B switch; ``0`` never)."""
    from llmd.quant.packed_linear import PackedLinear

    if os.environ.get("LLMD_DP_LINEAR") == "1":
        return True
    return not any(isinstance(m, PackedLinear) for m in model.modules())


def install() -> bool:
    """Register :func:`linear` with :mod:`llmd.quant.prepacked` when :func:`available`; returns
    whether it did, i.e. whether ``prepack_model`` packs in tile order for it."""
    if not available():
        return False
    prepacked.tile_linear, prepacked.tile_kernel = linear, "VDPBF16PS"
    prepacked.tile_pack, prepacked.tile_unpack = prepacked.dp_pack, prepacked.dp_unpack
    return True
