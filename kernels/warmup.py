"""Start-up warm-up: compile (by running once, on tiny tensors) every Triton kernel variant a
model will launch, before the daemon answers requests, so a compile error fails the start with
one line instead of aborting the first requests.

A *variant* is one set of constexprs (plus ``num_warps`` / ``num_stages``): Triton compiles one
binary per variant and device, and per-step integers (token counts, split lengths, strides) are
not specialized, so this list is complete for a model configuration:

* ``store_kv``: one (head_dim, block size, KV format, static or dynamic scales); none for int4
  (stored by torch ops, :mod:`llmd.kernels.kivi`), whose decode and prefill are the KIVI kernels
  (``kivi_decode.py``, ``kivi_prefill.py``);
* ``decode``: per attention kind the model has (full, sliding window), the direct kernel (one
  split: short contexts) and, when ``max_model_len`` allows more than one split, the split kernel;
* ``merge``: the split-KV merge for every ``SPLITS_PAD`` (power of two >= the split count) that
  contexts up to ``max_model_len`` reach (:func:`~llmd.kernels.decode_attention.num_decode_splits`);
* ``prefill``: per attention kind.

The tensors are built with the launchers' own code (:func:`store_kv_launch`,
:func:`decode_launches`, :func:`prefill_launch`), so the constexprs are exactly those of a real
step. On CPU (no CUDA device) :func:`warm_up` does nothing: the engine's CPU backends compile
nothing, and the Triton interpreter (tests only) has no compile step.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from llmd.kernels.decode_attention import decode_launches, num_decode_splits
from llmd.kernels.kivi_decode import kivi_decode_launches
from llmd.kernels.kivi_prefill import kivi_prefill_launch
from llmd.kernels.kv_store import store_kv_launch
from llmd.kernels.launch import DECODE_BLOCK_N, Launch, capability_of
from llmd.kernels.prefill_attention import prefill_launch
from llmd.quant.kv import PagedKVCache, get_format


@dataclasses.dataclass(frozen=True)
class WarmupSpec:
    """What decides the variants: the model's attention shape and the cache settings.

    Attributes:
        head_dim, num_heads, num_kv_heads: attention shape.
        dtype: model dtype (float32 / bfloat16 / float16).
        block_size: tokens per KV block.
        kv_cache_dtype: "auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4".
        static_scales: ``--kv-scales`` given (the store kernel's STATIC constexpr).
        windows: the attention kinds present: ``None`` (full) and/or a window in tokens (its
            value is a runtime argument, so one window stands for all).
        max_model_len: longest context (tokens): bounds the decode split counts.
    """

    head_dim: int
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    block_size: int
    kv_cache_dtype: str = "auto"
    static_scales: bool = False
    windows: tuple[int | None, ...] = (None,)
    max_model_len: int = 2048


def merge_pads(max_model_len: int, block_n: int = DECODE_BLOCK_N) -> list[int]:
    """Every ``SPLITS_PAD`` the merge kernel gets for contexts of 1..``max_model_len`` tokens."""
    most = num_decode_splits(max_model_len, block_n)
    return sorted({triton.next_power_of_2(s) for s in range(2, most + 1)})


def warmup_launches(spec: WarmupSpec, device: str | torch.device,
                    capability: int | None = None) -> list[tuple[str, Launch]]:
    """``(name, Launch)`` for every variant of ``spec`` (names like ``decode window=on split``),
    on tiny tensors on ``device``; ``capability`` defaults to the device's (tests pass one). A
    merge entry is the merge kernel alone: the values it reads do not matter to its compilation."""
    dev = torch.device(device)
    cap = capability_of(dev) if capability is None else capability
    fmt = get_format(spec.kv_cache_dtype)
    bs, nkv, nh, hd, dt = spec.block_size, spec.num_kv_heads, spec.num_heads, spec.head_dim, spec.dtype
    blocks = triton.cdiv(2 * DECODE_BLOCK_N, bs) + 1
    static = (1.0, 1.0) if spec.static_scales and fmt.quantized else None
    cache = PagedKVCache.allocate((2, blocks, bs, nkv, hd), fmt, dt, dev, static_scales=static, residual_slots=1)
    tables = torch.arange(1, blocks, dtype=torch.int32, device=dev)[None]
    k = torch.zeros(2, nkv, hd, dtype=dt, device=dev)
    decode, prefill = _attention_launchers(cache, cap)
    out = [] if fmt.k_per_block else [
        ("store_kv", store_kv_launch(k, k, cache, torch.tensor([bs, bs + 1], device=dev), capability=cap))]
    kinds = sorted({w is not None for w in spec.windows})
    for windowed in kinds:
        window, tag = (DECODE_BLOCK_N, "window=on") if windowed else (None, "window=off")
        q = torch.zeros(1, nh, hd, dtype=dt, device=dev)
        modes = ((1, "direct"), (2, "split")) if merge_pads(spec.max_model_len) else ((1, "direct"),)
        for splits, mode in modes:
            seq_len = DECODE_BLOCK_N * splits
            lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
            _, launches = decode(q, tables, lens, seq_len, hd**-0.5, window, splits)
            out.append((f"decode {tag} {mode}", launches[0]))
        qs = torch.zeros(3, nh, hd, dtype=dt, device=dev)
        _, launch = prefill(qs, tables, torch.tensor([0, 3], dtype=torch.int32, device=dev),
                            torch.tensor([3], dtype=torch.int32, device=dev), 3, hd**-0.5, window)
        out.append((f"prefill {tag}", launch))
    q = torch.zeros(1, nh, hd, dtype=dt, device=dev)
    for pad in merge_pads(spec.max_model_len):
        seq_len = DECODE_BLOCK_N * pad
        table = tables[:, :1].expand(1, triton.cdiv(seq_len, bs)).contiguous()
        lens = torch.tensor([1], dtype=torch.int32, device=dev)
        _, launches = decode(q, table, lens, seq_len, hd**-0.5, None, pad)
        out.append((f"merge splits_pad={pad}", launches[1]))
    return out


def _attention_launchers(cache: PagedKVCache, cap: int):
    """``(decode, prefill)``: the launch builders of ``cache``'s format with the format's own
    operands bound (int4: the KIVI kernels, own K from the residual: one slot, rows from 0)."""
    if not cache.fmt.k_per_block:
        return (functools.partial(_decode, cache=cache, capability=cap),
                functools.partial(_prefill, cache=cache, capability=cap))
    own = cache.residual.view(-1, *cache.residual.shape[2:])
    rows = torch.zeros(1, dtype=torch.int64, device=own.device)

    def decode(q, tables, lens, max_len, scale, window, splits):
        return kivi_decode_launches(q, cache, tables, lens, own, rows, max_len, scale, window, splits)

    def prefill(q, tables, qsl, lens, max_q, scale, window):
        return kivi_prefill_launch(q, cache, tables, qsl, lens, own, rows, max_q, scale, window)

    return decode, prefill


def _decode(q, tables, lens, max_len, scale, window, splits, cache, capability):
    return decode_launches(q, cache, tables, lens, max_len, scale, window, splits, capability=capability)


def _prefill(q, tables, qsl, lens, max_q, scale, window, cache, capability):
    return prefill_launch(q, cache, tables, qsl, lens, max_q, scale, window, capability=capability)


def run_launches(spec: WarmupSpec, launches: list[tuple[str, Launch]], arch: str) -> int:
    """Run ``launches`` in order; returns how many ran.

    Raises:
        RuntimeError: one line naming the variant, ``arch`` (e.g. ``sm_90``), the spec and the
            compiler's first error line.
    """
    for name, launch in launches:
        try:
            launch()
        except Exception as e:  # triton's CompilationError, ptxas failures, out of resources, ...
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            raise RuntimeError(
                f"Triton kernel {name} failed to compile for {arch} (head_dim {spec.head_dim}, "
                f"{spec.num_heads}/{spec.num_kv_heads} heads, {str(spec.dtype).removeprefix('torch.')}, "
                f"KV {spec.kv_cache_dtype}, block {spec.block_size}): {type(e).__name__}: {first}") from None
    return len(launches)


def warm_up(spec: WarmupSpec, device: str | torch.device) -> int:
    """Compile every variant of ``spec`` on a CUDA ``device`` by running it once; returns how many
    ran. On CPU a no-op that returns 0. Raises RuntimeError as :func:`run_launches`."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    n = run_launches(spec, warmup_launches(spec, dev), f"sm_{capability_of(dev)}")
    torch.cuda.synchronize(dev)
    return n
