"""What the Triton launchers choose at launch time, in one place the compile test can call too.

Each launcher (``kv_store.py``, ``decode_attention.py``, ``prefill_attention.py``) first builds
:class:`Launch` objects (kernel, grid, arguments, constexprs, ``num_warps``) and then runs
them; ``tests/test_kernel_compile.py`` builds the same objects from CPU tensors of the engine's
shapes and dtypes and compiles them for ``sm_80`` / ``sm_90`` without a GPU, so what CI
compiles is exactly what the engine launches.

**fp8_e4m3 before sm_89** (A100 = sm_80): Triton has no ``fp8e4nv`` type there ("not supported
in this architecture"), so the launchers pass the e4m3 cache as ``uint8`` and the kernels
encode / decode the bits in integer arithmetic (:data:`FP8_E4M3_SOFTWARE`): the same codes,
bit for bit, as torch's ``float8_e4m3fn`` (tested under the interpreter with the software path
forced). fp8_e5m2, int8 and 16-bit caches compile natively on sm_80.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

#: Tile sizes the engine launches with (``kernels/ops.py`` uses the launchers' defaults).
DECODE_BLOCK_N = 32
PREFILL_BLOCK_Q = 16
PREFILL_BLOCK_N = 32
STORE_BLOCK_T = 16
#: head_dim range of the kernels (a power of two: ``tl.arange`` over it).
HEAD_DIMS = (16, 32, 64, 128, 256)
#: Model dtypes the Triton backend runs (float64 reference runs are torch-only).
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: First compute capability with a native e4m3 type in Triton (Ada, Hopper).
FP8_E4M3_NATIVE_CAPABILITY = 89
#: ``capability`` value meaning "no real device" (CPU tensors under ``TRITON_INTERPRET=1``):
#: every type is native there.
INTERPRETER = 0


@dataclass
class Launch:
    """One kernel launch: ``kernel[grid](*args, **kwargs)`` (kwargs = constexprs + ``num_warps``)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict = field(default_factory=dict)

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def capability_of(device: torch.device) -> int:
    """``10 * major + minor`` of a CUDA device (80 for A100, 90 for H100/H200); :data:`INTERPRETER`
    for CPU tensors."""
    if device.type != "cuda":
        return INTERPRETER
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def fp8_e4m3_in_software(fmt_name: str, capability: int) -> bool:
    """True where the kernels must handle e4m3 codes as uint8 bits (see the module docstring)."""
    return fmt_name == "fp8_e4m3" and capability != INTERPRETER and capability < FP8_E4M3_NATIVE_CAPABILITY


def cache_operands(cache, capability: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K data, V data, K scales, V scales) as the kernels take them: e4m3 data viewed as uint8
    before sm_89; for ``auto`` caches the scale operands are unused stand-ins (K/V data views)."""
    data = cache.data
    if fp8_e4m3_in_software(cache.fmt.name, capability):
        data = data.view(torch.uint8)
    sc = cache.scales if cache.fmt.quantized else cache.data[..., 0]
    return data[0], data[1], sc[0], sc[1]


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def check_triton_config(head_dim: int, num_heads: int, num_kv_heads: int, model_dtype: torch.dtype,
                        block_size: int, kv_cache_dtype: str = "auto", decode_block_n: int = DECODE_BLOCK_N,
                        prefill_block_n: int = PREFILL_BLOCK_N) -> None:
    """Refuse, with one line, a configuration the Triton kernels cannot run.

    Meant for configuration time (before any weights load or kernel launches); the launchers call
    it too, so a direct caller gets the same line instead of a Triton compile error.

    Raises:
        ValueError: head_dim not a power of two in 16..256, num_heads not a multiple of
            num_kv_heads, a tile size that is not a power of two ≥ 16, an unsupported model dtype,
            block_size < 1, an unknown KV cache dtype, int4 with a block size that is not a power
            of two ≥ 16.
    """
    _check(head_dim, num_heads, num_kv_heads, model_dtype, block_size, kv_cache_dtype, decode_block_n, prefill_block_n)


@functools.lru_cache(maxsize=256)
def _check(head_dim, num_heads, num_kv_heads, model_dtype, block_size, kv_cache_dtype, decode_block_n, prefill_block_n):
    from llmd.quant.kv import KV_CACHE_FORMATS

    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the triton attention backend needs head_dim a power of two in 16..256, got {head_dim} "
                         "(use --attention-backend torch)")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"the triton attention backend needs num_heads ({num_heads}) to be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    for name, bn in (("decode block_n", decode_block_n), ("prefill block_n", prefill_block_n)):
        if not _pow2(bn) or bn < 16:
            raise ValueError(f"the triton attention backend needs {name} a power of two >= 16 (tl.dot), got {bn}")
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"the triton attention backend runs float32/bfloat16/float16 models, got {model_dtype} "
                         "(use --attention-backend torch)")
    if block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {block_size}")
    if kv_cache_dtype not in KV_CACHE_FORMATS:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_FORMATS)}, got {kv_cache_dtype!r}")
    if KV_CACHE_FORMATS[kv_cache_dtype].k_per_block and (not _pow2(block_size) or block_size < 16):
        raise ValueError(f"the triton attention backend needs --block-size a power of two >= 16 with "
                         f"--kv-cache-dtype {kv_cache_dtype} (a key tile is one block), got {block_size}")
