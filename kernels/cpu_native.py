"""The cpu backend's decode attention in C: every decode of a step in one call per layer, reading
the paged K/V in place (``kernels/native/paged_decode.c``, built by :mod:`llmd.kernels.native.build`).

Why: the torch path (:mod:`llmd.kernels.cpu_attention`) gathers each decode's K/V into a
workspace (a copy of everything it reads), converts it, and runs thin batched matmuls
(``group × L`` per KV head) far from the CPU's peak; at batch 32 × 512 keys that was 5.8× the
KV-read floor. This kernel reads each key once from the cache, scores the KV head's query group
against it and folds it into an online softmax, all in float32 registers and one OpenMP team
(torch's). Same attention: ``softmax(scale · q Kᵀ) V`` per (sequence, query head) over keys
``[first, seq_len)``; int8/fp8 keys as ``code × scale`` per (token, KV head).

Numerics: float32 throughout (a bfloat16 model's bfloat16 queries and K/V are widened exactly;
scores, softmax and the ``probs · V`` sum stay float32 and only the output is rounded to
bfloat16), keys in position order per sequence, so a sequence's output is independent of the
batch it runs in (case S4 holds exactly on this path). Tested against the float64 reference in
``tests/kernels/test_cpu_native.py``.

On CPUs with AMX (Intel Sapphire Rapids and later) the scores of bfloat16 queries over a
bfloat16 cache run on the tile unit (``kernels/native/amx_decode.h``: one TDPBF16PS per 32
channels of a 16-slot group's K rows, loaded as the cache stores them; float32 sums of exact
bfloat16 products) while the softmax and ``probs · V`` stay as above; measured side by side
(``benchmarks/native_decode.py``) 0.85-0.92x the vector kernel's time at batch 32 x 512 on the
2-core machine. :func:`tile_scores` says when; ``LLMD_AMX_ATTENTION=0`` turns it off. On CPUs
with AVX512-BF16 but no AMX (AMD Zen 4, Intel Cooper Lake) the same case runs through
``kernels/native/bf16dp_decode.h``: scores by VDPBF16PS on the raw bfloat16 query and K rows
(exact products, float32 sums, the scale applied to the sums) and the float32 ``probs · V`` over
V widened by two bit operations; :func:`dot_scores` says when, ``LLMD_BF16_DOT=0`` turns it off.
Both keep the position order per sequence, so S4 holds on them too. Those probes and switches live
in :mod:`llmd.kernels.cpu_native_paths` (re-exported here).

Not served here (the torch path runs instead): float64 models (the oracle's own dtype), grouped
scales (``--kv-scale-group-size``), int4 caches, block sizes over 128, head_dim over 256 or not a
multiple of 16, more than 16 query heads per KV head, or when the kernel is unavailable (:func:`available`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmd.kernels.cpu_native_paths import (  # noqa: F401 (re-exported: the paths' probes and switches)
    amx_available,
    dot_available,
    dot_scores,
    set_amx,
    set_avx2,
    set_dot,
    tile_scores,
)
from llmd.kernels.native import build
from llmd.quant.kv import PagedKVCache, planes_contiguous
from llmd.quant.kv_format import KVCacheFormat

_KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}  # paged_decode.c's KV_*
_KV_LUT = 4  # any other 1-byte code (fp8): through a 256-entry table
_BYTE_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
_Q_CODES = {torch.float32: 0, torch.bfloat16: 1}
_luts: dict[torch.dtype, torch.Tensor] = {}
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 128  # paged_decode.c's fixed tile sizes


def available() -> bool:
    """The kernel built and loaded on this machine (:mod:`llmd.kernels.native.build`; the first
    call builds its runtime-shape variant, ~1.5 s)."""
    return build.load() is not None


def prepare(head_dim: int, group: int) -> bool:
    """Build (first time on this machine, ~3 s) and load the variant specialized for a model's
    shape, which :func:`decode` then uses; engines call this at start-up. Returns availability."""
    return supports_shape(head_dim, group) and build.load((head_dim // 16, group)) is not None


def supports_shape(head_dim: int, group: int) -> bool:
    """The kernel's fixed limits: head_dim a multiple of 16 up to 256, at most 16 query heads per KV head."""
    return head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and group <= MAX_GROUP


def _lib(head_dim: int, group: int):
    """The specialized variant when :func:`prepare` loaded it, else the runtime-shape one."""
    return build.loaded((head_dim // 16, group)) or build.load()


def serves(fmt: KVCacheFormat, cdt: torch.dtype, block_size: int) -> bool:
    """The KV formats, compute dtypes and block sizes the kernel reads (not grouped scales, not
    int4, float32/bfloat16 compute, blocks of at most 128 tokens)."""
    return cdt in _Q_CODES and not fmt.group_size and not fmt.k_per_block and block_size <= MAX_BLOCK


def unserved_reason(fmt: KVCacheFormat, cdt: torch.dtype, block_size: int, head_dim: int, group: int) -> str | None:
    """Why the kernel does not serve this configuration (the first limit it fails, in words for
    the startup line), or None when :func:`serves` and :func:`supports_shape` both hold."""
    if cdt not in _Q_CODES:
        return f"compute dtype {str(cdt).removeprefix('torch.')} (the kernel takes float32 and bfloat16)"
    if fmt.group_size:
        return "grouped KV scales (--kv-scale-group-size)"
    if fmt.k_per_block:
        return f"KV cache {fmt.name} (its own kernels)"
    if block_size > MAX_BLOCK:
        return f"block size {block_size} > {MAX_BLOCK}"
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} (a multiple of 16 up to {MAX_HEAD_DIM})"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head > {MAX_GROUP}"
    return None


def supports(cache: PagedKVCache, cdt: torch.dtype, group: int) -> bool:
    """This kernel can serve the decodes of a step over ``cache`` in compute dtype ``cdt``."""
    data = cache.data
    return (serves(cache.fmt, cdt, data.shape[2]) and (data.dtype in _KV_CODES or data.dtype in _BYTE_DTYPES)
            and planes_contiguous(data) and supports_shape(data.shape[4], group)
            and _lib(data.shape[4], group) is not None)


def _lut(dtype: torch.dtype) -> torch.Tensor:
    """``[256]`` float32: the value of each 1-byte code of ``dtype`` (int8 two's complement, fp8 bits)."""
    t = _luts.get(dtype)
    if t is None:
        t = _luts[dtype] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)
    return t


@dataclass
class Decodes:
    """A step's decodes for the kernel (built once per step per KV cache group).

    Attributes:
        tokens: ``[Bd]`` int64 flat query-token index of each decode.
        table_rows: ``[Bd]`` int64 row of ``block_tables`` holding each decode's blocks.
        first, seq_lens: ``[Bd]`` int64, the keys attended are positions ``[first, seq_len)``
            (``first`` > 0 under a sliding window or after a cascade's shared prefix).
        block_tables: ``[B, max_blocks]`` int32, contiguous.
    """

    tokens: torch.Tensor
    table_rows: torch.Tensor
    first: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


def _step_args(data: torch.Tensor, d: Decodes, num_heads: int, scale: float) -> tuple[tuple, tuple]:
    """The arguments of ``llmd_paged_decode`` that one step fixes for every layer of a KV cache
    group, in the C function's order: (the cache's dtype code and its value table, as they follow
    the cache pointer) and (the shape, block tables, decode lists and softmax scale, as they
    follow the K-to-V distances). The tables of 1-byte codes live in :data:`_luts` for good."""
    _, _, block_size, kv_heads, head_dim = data.shape
    lut = _lut(data.dtype) if data.dtype in _BYTE_DTYPES and data.dtype != torch.int8 else None  # int8: widened
    return ((_KV_CODES.get(data.dtype, _KV_LUT), lut.data_ptr() if lut is not None else None),
            (block_size, kv_heads, head_dim, num_heads, d.block_tables.data_ptr(), d.block_tables.stride(0),
             d.table_rows.data_ptr(), d.tokens.data_ptr(), d.first.data_ptr(), d.seq_lens.data_ptr(),
             d.tokens.shape[0], scale))


def decode(query: torch.Tensor, cache: PagedKVCache, d: Decodes, scale: float, out: torch.Tensor,
           lse: torch.Tensor | None = None) -> None:
    """Write the decodes' attention outputs into ``out`` (rows ``d.tokens``; other rows untouched).

    Args:
        query: ``[T, num_heads, head_dim]`` float32 or bfloat16, heads and channels contiguous
            (a row stride of its own, e.g. a slice of a fused QKV projection, is fine).
        cache: the layer's cache (:func:`supports` holds), the step's own K/V already stored.
        d: the step's :class:`Decodes`; ``scale``: softmax scale.
        out: ``[T, num_heads, head_dim]`` float32 or bfloat16, contiguous.
        lse: None, or ``[T, num_heads]`` float32 contiguous: each decode row's log-sum-exp of its
            scaled scores (natural log), for :mod:`llmd.kernels.cpu_cascade`'s merge.
    Raises:
        ValueError: a layout the kernel cannot read (the caller checks :func:`supports` first).
    """
    t, num_heads, head_dim = query.shape
    data = cache.data
    kv_heads = data.shape[3]
    if query.stride(2) != 1 or query.stride(1) != head_dim or not out.is_contiguous() or out.shape != query.shape:
        raise ValueError("cpu_native.decode: query heads/channels and out must be contiguous, out shaped like query")
    if lse is not None and (lse.dtype != torch.float32 or not lse.is_contiguous()):
        raise ValueError("cpu_native.decode: lse must be contiguous float32 [T, num_heads]")
    scales = cache.scales if cache.fmt.quantized else None
    if scales is not None and not planes_contiguous(scales):
        raise ValueError("cpu_native.decode: each plane of the cache's scales must be contiguous")
    kv_args, step_args = _step_args(data, d, num_heads, scale)
    rc = _lib(head_dim, num_heads // kv_heads).llmd_paged_decode(
        query.data_ptr(), _Q_CODES[query.dtype], query.stride(0), data.data_ptr(), *kv_args,
        scales.data_ptr() if scales is not None else None, data.stride(0),
        scales.stride(0) if scales is not None else 0, *step_args,
        out.data_ptr(), _Q_CODES[out.dtype], lse.data_ptr() if lse is not None else None, torch.get_num_threads())
    if rc != 0:
        raise ValueError("cpu_native.decode: sizes past the kernel's limits (check supports() first)")


def gather_read(cache: PagedKVCache, d: Decodes) -> int:
    """Read every K and V byte (and 8-bit scale) the decodes ``d`` attend to, through their block
    tables in this kernel's order, and nothing more (``kernels/native/kv_read.c``): the KV-gather
    floor ``llmd bench step`` prints. Returns the bytes' wrapped 64-bit sum.

    Raises:
        ValueError: an int4 or grouped-scale cache, or planes not each contiguous.
        RuntimeError: the C library is unavailable.
    """
    data = cache.data
    if cache.fmt.k_per_block or cache.fmt.group_size or not planes_contiguous(data):
        raise ValueError("cpu_native.gather_read: a cache this kernel does not read")
    scales = cache.scales if cache.fmt.quantized else None
    if scales is not None and not planes_contiguous(scales):
        raise ValueError("cpu_native.gather_read: each plane of the cache's scales must be contiguous")
    lib = build.load_kv_read()
    if lib is None:
        raise RuntimeError("cpu_native.gather_read: the C library is unavailable")
    es = data.element_size()
    return lib.llmd_kv_gather_read(
        data.data_ptr(), data.stride(0) * es, data.shape[3] * data.shape[4] * es,
        scales.data_ptr() if scales is not None else None,
        scales.stride(0) * scales.element_size() if scales is not None else 0,
        scales.shape[3] * scales.element_size() if scales is not None else 0, data.shape[2],
        d.block_tables.data_ptr(), d.block_tables.stride(0), d.table_rows.data_ptr(), d.first.data_ptr(),
        d.seq_lens.data_ptr(), d.tokens.shape[0], torch.get_num_threads())


class DecodeCall:
    """A step's decodes bound to the kernel once, then called per layer with only that layer's
    query and cache (:func:`llmd.kernels.cpu_attention.decode_call` builds and caches it per step
    and KV cache group).

    Why: :func:`decode` checks the layouts and packs its 25 arguments in every call, and the
    dispatch in front of it (``kernels.paged_attention`` → ``cpu_attention.paged_attention``)
    looks the step plan up again; together ~20 µs per layer, ~0.6 ms of a batch-32 SmolLM2 step
    (measured in one process: 30 layers' attention 15.1-15.4 ms through the dispatch, 14.5-14.7
    with :func:`decode` alone). Here the step's arguments are packed once; a call passes
    pointers. The C call and its arguments are the ones :func:`decode` makes, so the outputs are
    the same bits.

    Serves the caches :func:`supports` accepts (every layer of a group has the same format,
    shape and plane strides); queries and outputs ``[T, num_heads, head_dim]`` in the compute
    dtype ``cdt`` (float32 or bfloat16).
    """

    __slots__ = ("fn", "shape", "cdt", "dtype", "quantized", "head", "mid", "tail", "_keep")

    def __init__(self, cache: PagedKVCache, d: Decodes, num_heads: int, scale: float, cdt: torch.dtype):
        data = cache.data
        kv_heads, head_dim = data.shape[3], data.shape[4]
        if cdt not in _Q_CODES or not (data.dtype in _KV_CODES or data.dtype in _BYTE_DTYPES):
            raise ValueError(f"cpu_native.DecodeCall: {data.dtype} cache or {cdt} queries")
        self.fn = _lib(head_dim, num_heads // kv_heads).llmd_paged_decode
        self.shape, self.cdt, self.dtype = (d.tokens.shape[0], num_heads, head_dim), cdt, data.dtype
        self.quantized = cache.fmt.quantized
        self.head, self.mid = _step_args(data, d, num_heads, scale)
        self.tail = (_Q_CODES[cdt], None, torch.get_num_threads())  # output dtype (the query's), no lse, threads
        self._keep = d  # the index tensors the pointers above point into live as long as the call

    def __call__(self, query: torch.Tensor, cache: PagedKVCache | torch.Tensor) -> torch.Tensor:
        """The attention of ``query`` (``[T, num_heads, head_dim]`` ``cdt``, heads and channels
        contiguous; a row stride of its own is fine) over one
        layer's ``cache`` (a :class:`PagedKVCache`, or an ``auto`` data tensor, of the format it
        was built for); returns ``[T, num_heads, head_dim]`` ``cdt``. Raises ValueError on
        another layout."""
        data = cache.data if isinstance(cache, PagedKVCache) else cache
        scales = cache.scales if self.quantized and isinstance(cache, PagedKVCache) else None
        if query.shape != self.shape or query.dtype != self.cdt or query.stride(2) != 1 \
                or query.stride(1) != self.shape[2] or data.dtype != self.dtype or (self.quantized and scales is None):
            raise ValueError("cpu_native.DecodeCall: a query or cache unlike the one it was built for")
        out = torch.empty(self.shape, dtype=self.cdt)
        rc = self.fn(query.data_ptr(), self.tail[0], query.stride(0), data.data_ptr(), *self.head,
                     scales.data_ptr() if scales is not None else None, data.stride(0),
                     scales.stride(0) if scales is not None else 0, *self.mid, out.data_ptr(), *self.tail)
        if rc != 0:
            raise ValueError("cpu_native.DecodeCall: sizes past the kernel's limits")
        return out
