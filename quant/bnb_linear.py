"""A bias-free linear layer over bitsandbytes' weight formats: NF4 / FP4 blocks, LLM.int8().

Formats (bitsandbytes 0.50.2; NF4/FP4 from QLoRA, Dettmers et al. 2023; int8 from LLM.int8(),
Dettmers et al. 2022), each quantized from the float32 dequantization of the GGUF tensor:

* ``nf4`` / ``fp4``: ``bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type=...)``:
  every run of :data:`BLOCKSIZE` weights of the row-major ``[N, K]`` weight becomes 4-bit indices
  into the 16-value NF4 (FP4) table times the run's absmax (no double quantization of the absmax).
  Two layouts, chosen at load for the device (:func:`layout_for`):

  - ``"cpu"``: bitsandbytes' AVX512-BF16 layout (``functional._convert_weight_packed_for_cpu``,
    what ``Linear4bit.forward`` converts to on such a CPU): ``packed [N, K/2]`` uint8 in tiles of
    32 rows, ``scales`` = absmax ``[K/64, N]`` bfloat16; ``bnb.matmul_4bit`` runs the bundled
    ``gemv_4bit_inference_cpu_{nf4,fp4}_bf16`` for any number of rows, in bfloat16. Needs
    ``N % 32 == 0``, ``K % 64 == 0``, bfloat16 activations and a CPU with AVX512-BF16.
  - ``"plain"``: bitsandbytes' standard layout: ``packed [N·K/2, 1]`` uint8, ``scales`` = absmax
    ``[N·K/64]`` float32; ``bnb.matmul_4bit`` runs ``gemv_4bit`` / ``gemm_4bit`` (CUDA kernels; on
    a CPU the weight is dequantized to the activation dtype and multiplied by ``F.linear``).

  Bytes: ``N·K/2`` + absmax (4 B float32 per 64 weights plain, 2 B bfloat16 in the CPU layout):
  0.5625 / 0.53125 bytes per weight (:func:`llmd.models.weight_bytes.weight_bytes` counts the same).
* ``int8`` (CUDA's ``--weight-quant int8``): ``packed`` = CB ``[N, K]`` int8 and ``scales`` = SCB
  ``[N]`` float32 row absmax, ``CB = round(127·w / SCB)`` (``Linear8bitLt``'s weights). Forward is
  ``MatMul8bitLt``'s inference path through bitsandbytes' ops: activations cast to float16 and
  quantized per row (``int8_vectorwise_quant``); columns holding a value ``|x| >=``
  :data:`INT8_THRESHOLD` stay in float16 (``int8_mixed_scaled_mm``: the LLM.int8() outlier split);
  the result is cast back to the activation dtype. These ops also run on a CPU (``torch._int_mm``),
  which is how the tests check them; on a CPU ``--weight-quant int8`` uses torch's own kernel.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmd.quant.bnb import import_bitsandbytes

BLOCKSIZE = 64  # bitsandbytes' default 4-bit block (weights per absmax)
CPU_TILE = 32  # rows per tile of the CPU layout (``_convert_weight_packed_for_cpu``'s block_n)
INT8_THRESHOLD = 6.0  # LLM.int8()'s outlier threshold (transformers' ``llm_int8_threshold`` default)
KINDS = ("nf4", "fp4", "int8")


def layout_for(n: int, k: int, dtype: torch.dtype, device: str) -> str:
    """``"cpu"`` when bitsandbytes' AVX512-BF16 kernel can run an ``[n, k]`` weight on ``device``
    with ``dtype`` activations, else ``"plain"``."""
    if device != "cpu" or dtype != torch.bfloat16 or n % CPU_TILE or k % BLOCKSIZE:
        return "plain"
    return "cpu" if import_bitsandbytes().functional.has_avx512bf16() else "plain"


def quantize_4bit(w: torch.Tensor, kind: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` float32 (CPU) → ``(packed, scales)`` of :class:`BnbLinear` for ``kind``
    ("nf4" / "fp4") in ``layout`` ("cpu" / "plain"; shapes in the module docstring)."""
    functional = import_bitsandbytes().functional
    packed, state = functional.quantize_4bit(w.float().contiguous(), blocksize=BLOCKSIZE, quant_type=kind)
    if layout == "cpu":
        packed, state = functional._convert_weight_packed_for_cpu(packed, state, CPU_TILE)
    return packed.contiguous(), state.absmax.contiguous()


def quantize_int8(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` float32 → ``(CB [N, K] int8, SCB [N] float32)``: ``CB = round(127·w / SCB)``
    with ``SCB`` the row absmax (an all-zero row gets SCB 127 and zero codes)."""
    from llmd.quant.gguf_packs import int8_rows

    codes, scale = int8_rows(w)  # scale = absmax / 127
    return torch.from_numpy(codes), torch.from_numpy(scale * np.float32(127.0))


class BnbLinear(nn.Module):
    """``forward(x [..., in_features]) -> [..., out_features]`` in ``x``'s dtype, through bitsandbytes.

    Args:
        kind: "nf4" / "fp4" / "int8"; layout: "cpu" / "plain" (4-bit kinds; "plain" for int8).
        packed, scales: from :func:`quantize_4bit` / :func:`quantize_int8` (shapes in the module docstring).
        sizes: the parts of a fused projection (``split`` as :class:`MergedLinear`'s).
    Raises:
        ValueError: unknown kind or layout.
    """

    def __init__(self, in_features: int, out_features: int, kind: str, packed: torch.Tensor, scales: torch.Tensor,
                 layout: str = "plain", sizes: list[int] | None = None):
        super().__init__()
        if kind not in KINDS or layout not in ("cpu", "plain") or (kind == "int8" and layout != "plain"):
            raise ValueError(f"BnbLinear: bad kind/layout {kind!r}/{layout!r}")
        self.in_features, self.out_features = in_features, out_features
        self.kind, self.layout, self.sizes = kind, layout, sizes
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self._state = None  # the bitsandbytes QuantState of a 4-bit kind, built on first use per device

    def _apply(self, fn, recurse=True):  # .to(device) moves the buffers: rebuild the state there
        self._state = None
        return super()._apply(fn, recurse)

    def quant_state(self):
        """The ``bitsandbytes.functional.QuantState`` over this layer's buffers (4-bit kinds)."""
        if self._state is None:
            functional = import_bitsandbytes().functional
            code = functional.get_4bit_type(self.kind, device=self.scales.device)
            state = functional.QuantState(absmax=self.scales, shape=torch.Size([self.out_features, self.in_features]),
                                          code=code, blocksize=BLOCKSIZE, quant_type=self.kind,
                                          dtype=torch.bfloat16 if self.layout == "cpu" else torch.float32)
            if self.layout == "cpu":
                state.packing_format_for_cpu = True
            self._state = state
        return self._state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bnb = import_bitsandbytes()
        x2 = x.reshape(-1, self.in_features)
        if self.kind == "int8":
            x16 = x2.to(torch.float16)  # MatMul8bitLt casts the activations to float16 too
            ca, sca, outliers = bnb.functional.int8_vectorwise_quant(x16, threshold=INT8_THRESHOLD)
            y, _ = torch.ops.bitsandbytes.int8_mixed_scaled_mm(x16, ca, self.packed, sca, self.scales, outliers, None)
            y = y.to(x.dtype)
        else:
            xc = x2.to(torch.bfloat16) if self.layout == "cpu" else x2
            y = bnb.matmul_4bit(xc, self.packed.t(), self.quant_state()).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``y [..., sum(sizes)]`` → one view per part (fused projections only)."""
        return y.split(self.sizes, dim=-1)

    def nbytes(self) -> tuple[int, int]:
        """``(pack bytes, dense bytes)`` held by this layer (no dense copy: 0)."""
        return self.packed.nbytes + self.scales.nbytes, 0

    def spec(self) -> dict:
        """What :meth:`from_spec` needs besides the two buffers (the weights cache's metadata)."""
        return {"in": self.in_features, "out": self.out_features, "kind": self.kind, "layout": self.layout,
                "sizes": self.sizes}

    @classmethod
    def from_spec(cls, spec: dict, packed: torch.Tensor, scales: torch.Tensor) -> "BnbLinear":
        return cls(spec["in"], spec["out"], spec["kind"], packed, scales, spec["layout"], spec["sizes"])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.kind} (bitsandbytes, {self.layout} layout)"
