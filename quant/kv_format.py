"""The ``--kv-cache-dtype`` formats as plain data: storage and scale dtypes by name, code grids, bytes.

Torch-free, so capacity math (``llmd kv-size``, :mod:`llmd.daemon.core.kv_size`) runs without
importing torch (~1.4 s); :mod:`llmd.quant.kv` (the layout, quantize / dequantize) re-exports
everything here. A format names its dtypes (``"int8"``, ``"float8_e4m3fn"``, ...): the torch
dtypes are :attr:`KVCacheFormat.dtype` and :attr:`KVCacheFormat.scale_dtype`, resolved on first
use (importing torch then). Byte sizes come from :data:`ITEMSIZE`, the element size of each
dtype name (``torch.empty(0, dtype=d).element_size()``; checked against torch in
``tests/kv/test_kv_size_no_torch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: bytes per element of the dtypes a KV cache or a model can have, by torch attribute name
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1,
            "float8_e5m2": 1}


def itemsize(dtype: "torch.dtype | str") -> int:
    """Bytes per element of a torch dtype or of its name (``"bfloat16"`` or ``"torch.bfloat16"``).
    Raises KeyError for a dtype no KV cache or model uses."""
    if isinstance(dtype, str):
        return ITEMSIZE[dtype.removeprefix("torch.")]
    return dtype.itemsize


@dataclass(frozen=True)
class KVCacheFormat:
    """One ``--kv-cache-dtype``.

    Attributes:
        name: "auto", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2" or "int4".
        dtype_name: storage dtype's torch name, None for ``auto`` (the model dtype); ``"uint8"``
            for int4 (packed). ``float16`` / ``bfloat16`` store K/V rounded to that dtype, without
            scales (llama.cpp's default ``f16`` cache; vLLM's ``bfloat16``): half a float32 model's bytes.
        qmax: largest magnitude of a code (127, 448, 57344, 7); 0 for ``auto`` and the 16-bit floats.
        mantissa_bits, min_exponent: fp8 grid (3, -6 for e4m3fn; 2, -14 for e5m2); 0 for int8.
        bits: bits per code (8, or 4 for two codes per byte).
        group_size: channels per scale (0 = one scale per (token, KV head)); int4's V uses 16,
            and ``--kv-scale-group-size`` sets it for an 8-bit format (:meth:`with_scale_groups`).
        scale_dtype_name: the stored scales' torch dtype name (``"float32"``; ``"float16"`` for
            int4, whose scales are rounded to float16 *before* quantizing, so the codes are those
            of the stored scale).
        k_per_block: K quantized per (block, KV head, channel) over the block's tokens with an
            asymmetric float16 scale and zero point (KIVI, arXiv:2402.02750; codes 0..15), the
            open block's K kept in a 16-bit residual until it fills; V stays per token
            (``group_size`` channels per symmetric scale). int4 only.
    """

    name: str
    dtype_name: str | None
    qmax: float = 0.0
    mantissa_bits: int = 0
    min_exponent: int = 0
    bits: int = 8
    group_size: int = 0
    scale_dtype_name: str = "float32"
    k_per_block: bool = False

    @cached_property
    def dtype(self) -> "torch.dtype | None":
        """The storage dtype (``torch.int8``, ``torch.float8_e4m3fn``, ...), None for ``auto``."""
        import torch

        return None if self.dtype_name is None else getattr(torch, self.dtype_name)

    @cached_property
    def scale_dtype(self) -> "torch.dtype":
        """The scales' dtype (``torch.float32``, or ``torch.float16`` for int4)."""
        import torch

        return getattr(torch, self.scale_dtype_name)

    @property
    def quantized(self) -> bool:
        """Codes with scales (int8, fp8, int4); False for ``auto`` and the 16-bit float formats."""
        return self.qmax > 0

    @property
    def is_fp8(self) -> bool:
        return self.mantissa_bits > 0

    def storage_dtype(self, model_dtype: "torch.dtype") -> "torch.dtype":
        return model_dtype if self.dtype is None else self.dtype

    def bytes_per_element(self, model_dtype: "torch.dtype | str") -> int:
        """Bytes of one stored element: the format's own, or the model dtype's for ``auto``."""
        return itemsize(model_dtype) if self.dtype_name is None else ITEMSIZE[self.dtype_name]

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per (token, KV head, scale group) for each of K and V (0 for ``auto``)."""
        return ITEMSIZE[self.scale_dtype_name] if self.quantized else 0

    @property
    def packed(self) -> bool:
        """Two 4-bit codes per stored byte."""
        return self.bits == 4

    def code_dim(self, head_dim: int) -> int:
        """Stored elements per (token, KV head): ``head_dim``, or ``head_dim // 2`` packed."""
        return head_dim // 2 if self.packed else head_dim

    def scale_groups(self, head_dim: int) -> int:
        """Scales per (token, KV head): 0 for ``auto``, 1, or ``head_dim // group_size``."""
        if not self.quantized:
            return 0
        return head_dim // self.group_size if self.group_size else 1

    def head_bytes(self, head_dim: int, model_dtype: "torch.dtype | str", block_size: int = 16) -> float:
        """Bytes per (token, KV head) of K and V, halved (so ``2 · head_bytes`` is both), codes and
        scales: ``head_dim · 2`` for 16-bit ``auto``, ``head_dim + 4`` for int8/fp8; for int4
        ``(K + V) / 2`` with K ``head_dim / 2 + 4 · head_dim / block_size`` (a float16 scale and
        zero point per channel per block) and V ``head_dim / 2 + 2 · head_dim / 16``
        (``head_dim · 0.6875`` at block 16). ``model_dtype``: a torch dtype or its name."""
        return self.block_head_bytes(head_dim, model_dtype, block_size) / (2 * block_size)

    def block_head_bytes(self, head_dim: int, model_dtype: "torch.dtype | str", block_size: int) -> int:
        """Bytes of one block's K and V for one KV head (codes, scales, zero points; int)."""
        codes = self.code_dim(head_dim) * self.bytes_per_element(model_dtype)
        if self.k_per_block:
            k = block_size * codes + 2 * head_dim * self.scale_bytes
            v = block_size * (codes + self.scale_bytes * self.scale_groups(head_dim))
            return k + v
        return 2 * block_size * (codes + self.scale_bytes * self.scale_groups(head_dim))

    def block_scale_elems(self, head_dim: int, kv_heads: int, block_size: int) -> int:
        """int4: float16 values per block in the scales tensor ``[1, num_blocks, n]``: K's scale
        and zero point ``2 · kv_heads · head_dim``, then V's ``block_size · kv_heads · head_dim / 16``."""
        return 2 * kv_heads * head_dim + block_size * kv_heads * self.scale_groups(head_dim)

    def residual_dtype_name(self, model_dtype: "torch.dtype | str") -> str:
        """The 16-bit dtype of the open block's K residual: ``bfloat16`` for a bfloat16 model,
        else ``float16`` (values clamped to ±65504 first)."""
        return "bfloat16" if str(model_dtype).removeprefix("torch.") == "bfloat16" else "float16"

    @property
    def scheme(self) -> str:
        """What the block bytes mean, for the prefix cache's extra keys: the name, ``int4-kivi16``
        for int4, ``int8-g32`` for an 8-bit format with grouped scales."""
        if self.k_per_block:
            return f"{self.name}-kivi{self.group_size}"
        return f"{self.name}-g{self.group_size}" if self.group_size else self.name

    def with_scale_groups(self, group_size: int) -> "KVCacheFormat":
        """This 8-bit format with one scale per ``group_size`` consecutive channels of a (token,
        KV head) instead of one per (token, KV head) (``--kv-scale-group-size``; 0 = this format).

        Raises:
            ValueError (one line): a format without per-token scales to group (``auto``, int4,
            whose V groups are fixed at 16), or a group size that is not a power of two >= 8.
        """
        if not group_size:
            return self
        if not self.quantized or self.packed:
            raise ValueError(f"--kv-scale-group-size needs an 8-bit --kv-cache-dtype (int8, fp8_e4m3, fp8_e5m2), "
                             f"got {self.name}")
        if group_size < 8 or group_size & (group_size - 1):
            raise ValueError(f"--kv-scale-group-size must be 0 or a power of two >= 8, got {group_size}")
        return replace(self, group_size=group_size)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError (one line) if ``head_dim`` cannot be stored in this format."""
        if self.group_size and head_dim % self.group_size:
            what = (f"--kv-cache-dtype {self.name}" if self.packed
                    else f"--kv-scale-group-size {self.group_size}")
            raise ValueError(f"{what} needs head_dim a multiple of {self.group_size}, got {head_dim}")


KV_CACHE_FORMATS: dict[str, KVCacheFormat] = {
    "auto": KVCacheFormat("auto", None),
    "float16": KVCacheFormat("float16", "float16"),
    "bfloat16": KVCacheFormat("bfloat16", "bfloat16"),
    "int8": KVCacheFormat("int8", "int8", 127.0),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", "float8_e4m3fn", 448.0, 3, -6),
    "fp8_e5m2": KVCacheFormat("fp8_e5m2", "float8_e5m2", 57344.0, 2, -14),
    "int4": KVCacheFormat("int4", "uint8", 7.0, bits=4, group_size=16, scale_dtype_name="float16", k_per_block=True),
}


#: formats only the cpu and torch attention backends read (the Triton kernels and the GPU script's
#: check and bench cover the others; ``--attention-backend triton`` refuses these)
CPU_ONLY_FORMATS = ("float16", "bfloat16")


def get_format(name: "str | KVCacheFormat", scale_group_size: int = 0) -> KVCacheFormat:
    """Format by ``--kv-cache-dtype`` name (a :class:`KVCacheFormat` is returned as it is), with
    ``scale_group_size`` channels per scale (:meth:`KVCacheFormat.with_scale_groups`; 0 = the
    format's own). Raises ValueError listing the choices, or naming a bad group size."""
    if isinstance(name, KVCacheFormat):
        return name.with_scale_groups(scale_group_size)
    try:
        fmt = KV_CACHE_FORMATS[name]
    except KeyError:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_FORMATS)}, got {name!r}") from None
    return fmt.with_scale_groups(scale_group_size)
