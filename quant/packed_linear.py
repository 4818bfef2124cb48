"""A bias-free linear layer over torch's weight-only CPU kernels, optionally beside a dense copy.

Kernels (both ATen CPU ops, oneDNN-free, memory-bound at small batch):

* ``torch._weight_int4pack_mm_for_cpu(x [M, K], packed [N, K/2] uint8, 32,
  scales_zeros [K/32, N, 2]) -> [M, N]``: ``w = (q - 8) · scale + zero`` per group of 32 along K;
  packs from ``torch._convert_weight_to_int4pack_for_cpu(codes [N, K] int32, 1)``; the scales
  and zeros must have the activation dtype (bfloat16 or float32).
* ``torch._weight_int8pack_mm(x [M, K], codes [N, K] int8, scales [N]) -> [M, N]``: per-row
  symmetric int8, scales in the activation dtype.

The scales must have the activation dtype, and the int4 kernel on float32 activations is ~30×
slower than on bfloat16 here (95 vs 3.3 ms at M = 1), so a bfloat16 model keeps bfloat16
scales, rounded by least squares over each group's codes (:func:`fit_scales`); a float32 model
reproduces the file's GGUF values exactly.

Measured on the 2-core AVX512-BF16 machine (SmolLM2's 30 layers of linears, bfloat16):
M = 1: dense 8.3 ms, int4 3.5, int8 3.4; M = 8: 11.2 / 12.5 / 13.4; M = 32: 26.6 / 46.5 / 49.3;
M = 256: 136 / 369 / 387. The weight-only kernels win only for a handful of rows, so a layer
that keeps a ``dense`` copy uses the packs for ``M <= small_batch`` rows and the dense matmul
above it (a decode of one or a few streams reads ~4× fewer bytes; batches and prefill keep the
oneDNN bfloat16 GEMM).
"""

from __future__ import annotations

import torch
from torch import nn

from llmd.quant import fp16_linear, int8_groups, prepacked

SMALL_BATCH = 4  # rows at most that use the packs when a dense copy is kept (measured crossover ~6)


class PackedLinear(nn.Module):
    """``forward(x [..., in_features]) -> [..., out_features]`` in ``x``'s dtype.

    Exactly one of ``int4`` / ``int8`` / ``int8g`` holds the packs: ``int4 = (packed [N, K/2]
    uint8, scales_zeros [K/32, N, 2])``, ``int8 = (codes [N, K] int8, scales [N])``, ``int8g``:
    int8 with one scale per 32 input columns, :func:`llmd.quant.int8_groups.pack`'s pair (its
    ``small_batch`` rows or fewer take the bfloat16 nibble-split kernel); scales in ``x``'s
    dtype (the kernels require it). ``dense``: an optional ``[N, K]`` weight used for more than ``small_batch``
    rows. ``sizes``: the parts of a fused projection (``split`` as :class:`MergedLinear`'s).
    ``native``: optionally ``(kind, pack)``, the same weights in the fused single-stream decode
    kernel's layout (:mod:`llmd.quant.native_packs`; buffers ``native_codes``, ``native_scales``,
    ``native_mins``), read only by that kernel (:mod:`llmd.kernels.cpu_fused`), never by ``forward``.

    Raises:
        ValueError: not exactly one of the packs given.
    """

    def __init__(self, in_features: int, out_features: int, *, int4=None, int8=None, int8g=None,
                 dense: torch.Tensor | None = None, small_batch: int = SMALL_BATCH, sizes: list[int] | None = None,
                 native: tuple[str, tuple[torch.Tensor, ...]] | None = None):
        super().__init__()
        given = {kind: p for kind, p in (("int4", int4), ("int8", int8), ("int8g", int8g)) if p is not None}
        if len(given) != 1:
            raise ValueError("PackedLinear needs exactly one of int4 / int8 / int8g packs")
        self.in_features, self.out_features = in_features, out_features
        (self.kind, packs), = given.items()
        self.register_buffer("packed", packs[0], persistent=False)
        self.register_buffer("scales", packs[1], persistent=False)
        self.dense = None if dense is None else nn.Parameter(dense, requires_grad=False)
        self.small_batch = small_batch
        self.sizes = sizes
        self.native_kind = None if native is None else native[0]
        if native is not None:
            for role, t in zip(("native_codes", "native_scales", "native_mins"), native[1]):
                self.register_buffer(role, t, persistent=False)

    def native_pack(self) -> tuple[str, tuple[torch.Tensor, ...]] | None:
        """``(kind, pack)`` for the fused decode kernel, or None (see the class docstring)."""
        if self.native_kind is None:
            return None
        b = self._buffers
        return self.native_kind, tuple(b[r] for r in ("native_codes", "native_scales", "native_mins") if r in b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Tensors straight from the module's dicts: nn.Module.__getattr__ costs ~1.4 µs per
        # parameter or buffer here, and a batch-1 step makes 121 of these calls (3 lookups each);
        # 2-D inputs (every call from the models) skip the reshape and view.
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, self.in_features)
        dense = self._parameters.get("dense")
        if dense is not None and x2.shape[0] > self.small_batch:
            fp16 = self.__dict__.get(fp16_linear.ATTR)  # quant/fp16_linear.py, float32 inputs
            if fp16 is not None and fp16_linear.active and x2.dtype == torch.float32:
                y = fp16_linear.linear(x2, fp16)
            else:
                y = prepacked.linear(x2, dense)  # plain or oneDNN-prepacked (quant/prepacked.py)
        elif self.kind == "int4":
            y = torch._weight_int4pack_mm_for_cpu(x2, self._buffers["packed"], 32, self._buffers["scales"])
        elif self.kind == "int8g":
            y = int8_groups.linear(x2, self._buffers["packed"], self._buffers["scales"], self.small_batch)
        else:
            y = torch._weight_int8pack_mm(x2, self._buffers["packed"], self._buffers["scales"])
        return y if flat else y.view(*x.shape[:-1], self.out_features)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``y [..., sum(sizes)]`` → one view per part (fused projections only)."""
        return y.split(self.sizes, dim=-1)

    def nbytes(self) -> tuple[int, int]:
        """``(pack bytes, dense bytes)`` held by this layer."""
        packs = self.packed.nbytes + self.scales.nbytes
        return packs, 0 if self.dense is None else self.dense.nbytes

    def native_nbytes(self) -> int:
        """Bytes of the fused decode kernel's copy (0 without one)."""
        native = self.native_pack()
        return 0 if native is None else sum(t.nbytes for t in native[1])

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.kind}"
                + (f", dense above {self.small_batch} rows" if self.dense is not None else ""))


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ``dtype`` values bracketing float32 ``x`` (round-to-nearest first), as float32."""
    rn = x.to(dtype)
    other = torch.nextafter(rn, torch.where(rn.float() < x, torch.inf, -torch.inf).to(dtype))
    return rn.float(), other.float()


def fit_scales(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
    """Round a group's ``(scale, zero)`` to ``dtype`` by least squares over its own codes.

    ``w = (q - 8) · scale + zero`` is exact in float32; rounding both to bfloat16 (8 bits)
    independently shifts all 32 weights of a group. Instead each of the two bfloat16 neighbours
    of ``scale`` gets the zero that minimises the group's squared error for its codes
    (``mean(w - (q - 8) s)``), that zero's two neighbours are tried, and the best of the four
    pairs is kept. On SmolLM2 in bfloat16 this brings ΔNLL vs float32 from +0.28 % (plain
    rounding) to the figure in the README. Shapes: ``codes [N, K]``, ``scale``/``zero`` float32
    ``[N, K/32]``; returns both ``[N, K/32]`` in ``dtype``.
    """
    if dtype == torch.float32:
        return scale, zero
    q = codes.float().view(*scale.shape, 32) - 8.0
    w = q * scale[..., None] + zero[..., None]
    best_err = best_s = best_z = None
    for s in _neighbours(scale, dtype):
        for z in _neighbours((w - q * s[..., None]).mean(-1), dtype):
            err = ((q * s[..., None] + z[..., None] - w) ** 2).sum(-1)
            if best_err is None:
                best_err, best_s, best_z = err, s, z
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s.to(dtype), best_z.to(dtype)


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
    """``codes [N, K]`` (integers in [0, 16)), ``scale``/``zero`` float32 ``[N, K/32]`` →
    the ``int4`` packs of :class:`PackedLinear` (scales in ``dtype``, fitted by :func:`fit_scales`)."""
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scale, zero = fit_scales(codes, scale, zero, dtype)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return packed, sz


def pack_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """``codes [N, K]`` int8 and ``scale [N]`` float32 → the ``int8`` packs (scales in ``dtype``)."""
    return codes.contiguous(), scale.to(dtype).contiguous()
