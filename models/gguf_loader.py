"""Load a GGUF file into an llmd model: metadata → :class:`ModelConfig`, tensors → parameters.

A cold load parses the file with ``gguf.GGUFReader`` (slow on big vocabularies: ~20 s for
Gemma 3's 262k tokens on one CPU core; readers are cached per file). Metadata alone
(:func:`load_config`) comes from the lazy header reader and its cache
(:mod:`llmd.models.header_cache`), and with ``weights_cache`` a warm load maps the converted
model from :mod:`llmd.models.weights_cache` and never opens a ``GGUFReader``.

Dequantization is ``gguf.quants.dequantize`` (the ``gguf`` package from llama.cpp), which
covers F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K and more. Every GGUF tensor
must map to a parameter and every parameter must be filled, else loading fails naming it.
Fused projections (``qkv_proj``, ``gate_up_proj``) are filled part by part: each GGUF tensor
(``attn_q``, ``attn_k``, ...) lands in its rows (a :class:`~llmd.models.decoder.Slot`), the
parts tile the parameter (checked before loading), and parameters start as NaN, so a row no
tensor wrote stays visible.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmd.models.config import ModelConfig, read_config
from llmd.models.errors import GGUFLoadError
from llmd.models.registry import model_class

if TYPE_CHECKING:  # imported where a GGUF is parsed: a warm load (the weights cache) never needs it (~0.1 s)
    import gguf


def open_gguf(path: str) -> "gguf.GGUFReader":
    """Open a GGUF file (memory-mapped; cached per (path, mtime, size)). Raises GGUFLoadError
    if missing or not GGUF."""
    if not os.path.isfile(path):
        raise GGUFLoadError(f"model file not found: {path}")
    st = os.stat(path)
    return _open_cached(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> "gguf.GGUFReader":
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct.error on non-GGUF bytes
        raise GGUFLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def load_config(path: str) -> ModelConfig:
    """Read only the metadata of a GGUF file (the cached header, :mod:`llmd.models.header_cache`).
    Raises GGUFLoadError."""
    from llmd.models.header_cache import load_config as cached_config

    return cached_config(path)


def dequantize_tensor(t) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 numpy, shaped ``[rows, cols]`` (GGUF dims reversed)."""
    import gguf

    shape = tuple(int(d) for d in reversed(t.shape))
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFLoadError(f"tensor {t.name}: GGML type {t.tensor_type.name} is not supported by "
                            "gguf.quants") from None
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def check_slots_cover(slots: dict, params: dict[str, torch.Tensor]) -> None:
    """Check that the slots of ``model.gguf_tensor_map()`` cover every row of every parameter
    exactly once (fused projections: one slot per part), so loading every mapped tensor fills
    every parameter. Raises GGUFLoadError naming the first parameter that is not."""
    rows: dict[str, list[tuple[int, int]]] = {name: [] for name in params}
    for slot in slots.values():
        rows[slot.param].append(slot.rows or (0, params[slot.param].shape[0]))
    for name, ranges in rows.items():
        end = 0
        for start, stop in sorted(ranges):
            if start != end:
                break
            end = stop
        if end != params[name].shape[0] or not ranges:
            raise GGUFLoadError(f"llmd parameter {name} rows {sorted(ranges)} do not tile [0, {params[name].shape[0]})")


def cache_mode(weight_quant: str, device) -> str:
    """``weight_quant`` as the weights cache's key sees it: bitsandbytes layers depend on the device
    (layout, int8 backend) and on bitsandbytes' version (its CPU layout), so those modes carry both
    (``nf4@cpu|bitsandbytes0.50.2``; the version read from its metadata, not by importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    from llmd.models.weight_quant import uses_bnb

    dev = torch.device(device).type
    if not uses_bnb(weight_quant, dev):
        return weight_quant
    try:
        bnb = version("bitsandbytes")
    except PackageNotFoundError:
        bnb = "missing"
    return f"{weight_quant}@{dev}|bitsandbytes{bnb}"


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               weight_quant: str = "none", keep_dense: bool = False, weights_cache: bool = False,
               cache_dir: str | None = None, native: bool = False):
    """Build the architecture's model and fill it from the GGUF file.

    Args:
        path: GGUF file path.
        dtype: parameter / activation dtype (float32, bfloat16, float16).
        device: where parameters live.
        weight_quant, keep_dense: :func:`llmd.models.weight_quant.quantize_linears`'s ``mode``
            and ``keep_dense`` (CPU only); its summary is ``model.weight_quant_summary``.
        weights_cache: take the converted model from :mod:`llmd.models.weights_cache` when it
            holds a valid entry for these settings, else load from the GGUF and store one;
            cache_dir: its root (default the llmd cache dir; tests).
        native: also the fused single-stream decode kernel's packs (``quantize_linears``'s ``native``).
    Returns:
        ``(model, config)``; model in eval mode with ``requires_grad=False`` parameters.
    Raises:
        GGUFLoadError: unsupported architecture, unmapped tensor, shape mismatch, or a
            parameter left unfilled.
    """
    key = None
    if weights_cache:
        from llmd.models import weights_cache as wc
        from llmd.models.header_cache import header_info

        info = header_info(path, cache_dir)
        mode = cache_mode(weight_quant, device) + ("+fused" if native else "")
        key = wc.cache_key(path, info.data_offset, dtype, mode, keep_dense)
        model = wc.load_cached(model_class(info.config.architecture), info.config, dtype, key, cache_dir)
        if model is not None:
            return model.to(device).eval(), info.config
    reader = open_gguf(path)
    cfg = read_config(reader, name=os.path.splitext(os.path.basename(path))[0])
    cls = model_class(cfg.architecture)
    with torch.device("cpu"):
        model = cls(cfg, dtype)
    params = dict(model.named_parameters())
    for p in params.values():  # poison: anything the GGUF does not fill stays NaN
        p.data.fill_(float("nan"))
    slots = model.gguf_tensor_map()
    check_slots_cover(slots, params)
    loaded: set[str] = set()
    for t in reader.tensors:
        slot = slots.get(t.name)
        if slot is None:
            raise GGUFLoadError(f"GGUF tensor {t.name} ({cfg.architecture}) has no matching llmd parameter")
        w = model.transform_gguf_tensor(t.name, dequantize_tensor(t))
        dst = slot.of(params)
        if tuple(w.shape) != tuple(dst.shape):
            raise GGUFLoadError(f"GGUF tensor {t.name} has shape {tuple(w.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(torch.from_numpy(np.require(w, requirements="W")))
        loaded.add(t.name)
    missing = [name for name in slots if name not in loaded]
    if missing:
        raise GGUFLoadError(f"GGUF file lacks tensor {missing[0]} (and {len(missing) - 1} more)")
    from llmd.models.weight_quant import quantize_linears

    model.weight_quant_summary = quantize_linears(model, {t.name: t for t in reader.tensors}, weight_quant,
                                                  keep_dense=keep_dense, device=torch.device(device).type,
                                                  native=native)
    if key is not None:
        wc.store(model, key, cache_dir)
    model.to(device).eval()
    return model, cfg
