"""Load a GGUF file into an llmd model: metadata → :class:`ModelConfig`, tensors → parameters.

The header is parsed by ``gguf.GGUFReader`` (slow on big vocabularies: ~20 s for Gemma 3's
262k tokens on one CPU core), so readers are cached per file and the engine's second look at
a file (the tokenizer's header size) costs nothing.

Dequantization is ``gguf.quants.dequantize`` (the ``gguf`` package from llama.cpp), which
covers F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K and more. Every GGUF tensor
must map to a parameter and every parameter must be filled, else loading fails naming it.
"""

from __future__ import annotations

import functools
import os

import gguf
import numpy as np
import torch

from llmd.models.config import ModelConfig, read_config
from llmd.models.errors import GGUFLoadError
from llmd.models.registry import model_class


def open_gguf(path: str) -> gguf.GGUFReader:
    """Open a GGUF file (memory-mapped; cached per (path, mtime, size)). Raises GGUFLoadError
    if missing or not GGUF."""
    if not os.path.isfile(path):
        raise GGUFLoadError(f"model file not found: {path}")
    st = os.stat(path)
    return _open_cached(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct.error on non-GGUF bytes
        raise GGUFLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def load_config(path: str) -> ModelConfig:
    """Read only the metadata of a GGUF file. Raises GGUFLoadError."""
    return read_config(open_gguf(path), name=os.path.splitext(os.path.basename(path))[0])


def dequantize_tensor(t) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 numpy, shaped ``[rows, cols]`` (GGUF dims reversed)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFLoadError(f"tensor {t.name}: GGML type {t.tensor_type.name} is not supported by gguf.quants") from None
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Build the architecture's model and fill it from the GGUF file.

    Args:
        path: GGUF file path.
        dtype: parameter / activation dtype (float32, bfloat16, float16).
        device: where parameters live.
    Returns:
        ``(model, config)``; model in eval mode with ``requires_grad=False`` parameters.
    Raises:
        GGUFLoadError: unsupported architecture, unmapped tensor, shape mismatch, or a
            parameter left unfilled.
    """
    reader = open_gguf(path)
    cfg = read_config(reader, name=os.path.splitext(os.path.basename(path))[0])
    cls = model_class(cfg.architecture)
    with torch.device("cpu"):
        model = cls(cfg, dtype)
    params = dict(model.named_parameters())
    for p in params.values():  # poison: anything the GGUF does not fill stays NaN
        p.data.fill_(float("nan"))
    tensor_map = model.gguf_tensor_map()
    filled: set[str] = set()
    for t in reader.tensors:
        pname = tensor_map.get(t.name)
        if pname is None:
            raise GGUFLoadError(f"GGUF tensor {t.name} ({cfg.architecture}) has no matching llmd parameter")
        w = model.transform_gguf_tensor(t.name, dequantize_tensor(t))
        p = params[pname]
        if tuple(w.shape) != tuple(p.shape):
            raise GGUFLoadError(f"GGUF tensor {t.name} has shape {tuple(w.shape)}, expected {tuple(p.shape)}")
        p.data.copy_(torch.from_numpy(np.require(w, requirements="W")))
        filled.add(pname)
    missing = sorted(set(params) - filled)
    if missing:
        inv = {v: k for k, v in tensor_map.items()}
        raise GGUFLoadError(f"GGUF file lacks tensor {inv.get(missing[0], missing[0])} (and {len(missing) - 1} more)")
    model.to(device).eval()
    return model, cfg
