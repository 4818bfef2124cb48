"""A request's KV blocks as plain tensors, out of one engine and into another (prefill/decode
disaggregation; the block bookkeeping is :mod:`llmd.daemon.kv.transfer`).

* :class:`KVPayload`: what travels: per KV cache group, the K/V data (and int8/fp8/int4
  scales) of the blocks a consumer needs, as CPU tensors in the cache's storage dtype, plus
  the prompt's digest and the producer's :func:`kv_fingerprint`.
* :func:`kv_fingerprint`: everything that must agree between producer and consumer for the
  bytes to mean the same K/V: llmd's version, the model (name, architecture, a digest of its
  weights), dtype and weight format, block size, KV cache dtype and scheme (:attr:`KVCacheFormat.scheme`),
  static scales, rotation and the KV cache group layout. :func:`fingerprint_mismatch` names what differs.
* :func:`gather_blocks` / :func:`scatter_blocks`: the engine thread's copies between the
  runner's paged cache tensors and a payload (vLLM's NixlConnector moves the same per-layer
  block slices with RDMA; here they are copied through host memory).

Layout: the runner keeps ``group_size`` cache tensors ``[2, num_blocks, block_size, kv_heads,
code_dim]``; layer ``k`` of every group uses tensor ``k`` (:func:`llmd.daemon.kv.layer_placement`),
so a group's blocks ``ids`` are the slices ``caches[k][:, ids]`` for ``k < group_size``.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from llmd.quant import prepacked


@dataclass
class KVPayload:
    """The imported KV of one prompt.

    Attributes:
        num_prompt_tokens: ``P``; the payload holds the K/V of tokens ``[0, P - 1)`` at least
            (whole blocks: the last block's slots of ``P - 1`` and later are recomputed).
        token_digest: :func:`token_digest` of the prompt's token ids.
        fingerprint: the producer's :func:`kv_fingerprint`.
        ranges: per KV cache group, the table indices ``[first, end)`` the data covers
            (:func:`llmd.daemon.kv.transfer.import_ranges`).
        data: per group, ``[group_size, 2, end - first, block_size, kv_heads, code_dim]`` in
            the cache's storage dtype (CPU).
        scales: per group, ``[group_size, 2, end - first, block_size, kv_heads(, groups)]``
            float32 (int4: float16, ``[group_size, 1, end - first, per-block scales]``), or None
            for an ``auto`` cache.
        computed_tokens: set by the consumer that accepts it
            (:func:`llmd.daemon.kv.transfer.imported_tokens`: ``P - 1``, or the full blocks'
            tokens for int4, whose open-block residual does not travel); None until then.
    """

    num_prompt_tokens: int
    token_digest: str
    fingerprint: dict
    ranges: list[tuple[int, int]]
    data: list[torch.Tensor]
    scales: list[torch.Tensor | None] = field(default_factory=list)
    computed_tokens: int | None = None

    @property
    def num_computed_tokens(self) -> int:
        """Tokens the consumer marks computed: :attr:`computed_tokens`, by default ``P - 1`` (the
        last is recomputed for its logits)."""
        return self.num_prompt_tokens - 1 if self.computed_tokens is None else self.computed_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks over all groups."""
        return sum(end - first for first, end in self.ranges)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V data and scales."""
        return sum(t.numel() * t.element_size() for t in [*self.data, *self.scales] if t is not None)


def token_digest(token_ids: list[int]) -> str:
    """sha256 (hex) of the token ids as little-endian int64: both sides must hold the same prompt."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


def weights_digest(model: torch.nn.Module, sample: int = 64) -> str:
    """sha256 (hex, 16 chars) over every parameter and buffer's name, dtype, shape and its first
    and last ``sample`` values: tells two different GGUFs (or weight formats) of one
    architecture apart without reading all the weights (~10 ms for SmolLM2)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        flat = prepacked.dense(t.detach()).reshape(-1)  # a prepacked weight (oneDNN, AMX): its plain values
        h.update(f"{name}|{flat.dtype}|{tuple(t.shape)}|".encode())
        for part in (flat[:sample], flat[-sample:]):
            h.update(part.cpu().to(torch.float64).numpy().tobytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def llmd_version() -> str:
    """The installed llmd's version (``importlib.metadata``; "unknown" outside an install)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmd")
    except PackageNotFoundError:
        return "unknown"


def kv_fingerprint(engine) -> dict:
    """What producer and consumer must agree on (strings and ints; see the module docstring).
    ``engine``: an :class:`~llmd.daemon.core.engine.Engine` (read on its thread)."""
    c, cfg = engine.config, engine.model_config
    groups = ";".join(f"{g.name}:{','.join(map(str, g.layer_ids))}:{g.sliding_window}" for g in engine.kv_cache_groups)
    cache = engine.runner.caches[0]
    return {
        "llmd": llmd_version(),
        "model": f"{cfg.name}|{cfg.architecture}",
        "weights": weights_digest(engine.runner.model),
        "dtype": c.dtype,
        # "auto" keeps the dense weights beside the packs for steps of more tokens: "gguf+dense"
        "weight_quant": f"{c.weight_quant}{'+dense' if c.keep_dense and c.weight_quant != 'none' else ''}",
        "block_size": c.block_size,
        "kv_cache_dtype": c.kv_cache_dtype,
        "kv_scheme": cache.fmt.scheme,  # what the block bytes mean (int4: "int4-kivi16")
        "kv_scales": "dynamic" if c.kv_scales is None else f"{c.kv_scales[0]!r},{c.kv_scales[1]!r}",
        "kv_rotation": str(c.kv_rotation),
        "kv_layout": f"{cfg.num_layers}x{cfg.num_kv_heads}x{cfg.head_dim}|{str(cache.data.dtype)}|{groups}",
    }


def fingerprint_mismatch(ours: dict, theirs: dict) -> str | None:
    """None when the fingerprints agree, else one line naming each differing field with both values."""
    keys = sorted(set(ours) | set(theirs))
    diff = [f"{k} {theirs.get(k)!r} (producer) vs {ours.get(k)!r} (here)" for k in keys if ours.get(k) != theirs.get(k)]
    return "; ".join(diff) or None


def _index(ids: list[int], device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (torch's CPU index ops do not take float8 dtypes); others as they are."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


@torch.inference_mode()
def gather_blocks(caches, block_ids: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Copy the blocks ``block_ids`` (one id list per group) out of ``caches`` (the runner's
    ``group_size`` :class:`~llmd.quant.kv.PagedKVCache` s) into CPU tensors: ``(data, scales)``
    per group, shaped as :class:`KVPayload` says."""
    data, scales = [], []
    for ids in block_ids:
        idx = _index(ids, caches[0].data.device)
        data.append(_stack_select([_raw(c.data) for c in caches], idx).view(caches[0].data.dtype))
        scales.append(_stack_select([c.scales for c in caches], idx) if caches[0].scales is not None else None)
    return data, scales


def _stack_select(tensors: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """``torch.stack([t.index_select(1, idx) for t in tensors]).cpu()`` with one copy per
    tensor on a CPU device (each selection written in place into the stacked result)."""
    if tensors[0].device.type != "cpu":
        return torch.stack([t.index_select(1, idx) for t in tensors]).cpu()
    t0 = tensors[0]
    out = torch.empty((len(tensors), t0.shape[0], len(idx), *t0.shape[2:]), dtype=t0.dtype)
    for k, t in enumerate(tensors):
        torch.index_select(t, 1, idx, out=out[k])
    return out


def check_payload_shapes(caches, payload: KVPayload) -> None:
    """Raise ``ValueError`` naming the first group whose data or scales do not fit ``caches``
    (shape or dtype), so a malformed payload never reaches :func:`scatter_blocks`."""
    c0 = caches[0]
    if len(payload.data) != len(payload.ranges) or len(payload.scales) != len(payload.ranges):
        raise ValueError(f"{len(payload.ranges)} ranges but {len(payload.data)} data / {len(payload.scales)} scales")
    for g, ((first, end), data, scales) in enumerate(zip(payload.ranges, payload.data, payload.scales)):
        want = (len(caches), c0.data.shape[0], end - first, *c0.data.shape[2:])
        if tuple(data.shape) != want or data.dtype != c0.data.dtype:
            raise ValueError(f"group {g}: data {tuple(data.shape)} {data.dtype}, expected {want} {c0.data.dtype}")
        if (scales is None) != (c0.scales is None):
            raise ValueError(f"group {g}: scales {'missing' if scales is None else 'unexpected'}")
        if scales is not None:
            want_s = (len(caches), c0.scales.shape[0], end - first, *c0.scales.shape[2:])
            if tuple(scales.shape) != want_s or scales.dtype != c0.scales.dtype:
                raise ValueError(f"group {g}: scales {tuple(scales.shape)} {scales.dtype}, expected {want_s}")


@torch.inference_mode()
def scatter_blocks(caches, block_ids: list[list[int]], payload: KVPayload) -> None:
    """Write ``payload`` into the blocks ``block_ids`` (one list per group, of the lengths of
    ``payload.ranges``) of ``caches``. Raises ``ValueError`` (writing nothing) when shapes differ."""
    check_payload_shapes(caches, payload)
    for ids, data, scales in zip(block_ids, payload.data, payload.scales):
        if len(ids) != data.shape[2]:
            raise ValueError(f"{len(ids)} blocks allocated for {data.shape[2]} imported")
    for ids, data, scales in zip(block_ids, payload.data, payload.scales):
        idx = _index(ids, caches[0].data.device)
        for k, c in enumerate(caches):
            _raw(c.data).index_copy_(1, idx, _raw(data[k]).to(c.data.device))
            if scales is not None:
                c.scales.index_copy_(1, idx, scales[k].to(c.scales.device))
