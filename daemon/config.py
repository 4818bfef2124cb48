"""Engine configuration: one dataclass, validated once, shared by CLI, engine and tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmd.models.errors import LlmdError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_KV_CACHE_MEMORY_CPU = 512 * 1024**2  # bytes
CUDA_KV_CACHE_FRACTION = 0.8  # of free device memory after the weights are loaded


@dataclass
class EngineConfig:
    """Settings of one engine.

    Attributes:
        model: GGUF path or known model name (see ``llmd.models.registry``).
        dtype: "float32" / "bfloat16" / "float16"; ``None`` = float32 on CPU, bfloat16 on CUDA.
        device: "cpu" / "cuda"; ``None`` picks CUDA when available.
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV cache; ``None`` = 512 MiB on CPU, 80 % of free
            memory on CUDA.
        max_num_seqs: sequences running at once at most.
        max_num_batched_tokens: token budget of one step (tokens); ``None`` = 256 on CPU,
            4096 on CUDA.
        max_model_len: context cap (prompt + output tokens); ``None`` = the model's trained length.
    """

    model: str = "smollm2-135m"
    dtype: str | None = None
    device: str | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None

    def resolve(self) -> "EngineConfig":
        """Fill device-dependent defaults and validate. Raises LlmdError naming the bad setting."""
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise LlmdError(f"--device must be cpu or cuda, got {self.device!r}")
        on_cuda = self.device.startswith("cuda")
        if on_cuda and not torch.cuda.is_available():
            raise LlmdError("--device cuda requested but no CUDA device is available")
        if self.dtype is None:
            self.dtype = "bfloat16" if on_cuda else "float32"
        if self.dtype not in DTYPES:
            raise LlmdError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 4096 if on_cuda else 256
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise LlmdError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise LlmdError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise LlmdError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype or "float32"]


def parse_bytes(text: str) -> int:
    """Parse a byte size such as ``536870912``, ``512MiB``, ``2GiB``, ``300MB``. Raises LlmdError."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise LlmdError(f"cannot parse byte size {text!r} (try 512MiB or 2GiB)") from None
    if unit not in units or value <= 0:
        raise LlmdError(f"cannot parse byte size {text!r} (try 512MiB or 2GiB)")
    return int(value * units[unit])
