"""KV cache capacity math from a :class:`ModelConfig` alone (no weights loaded).

bytes/token = 2 · layers · kv_heads · (head_dim · bytes_per_element + scale_bytes), where the
8-bit formats store one float32 scale per (token, KV head) for K and for V (the scale layout
of :mod:`llmd.quant.kv`). SmolLM2 (30 layers, 3 KV heads × 64): 23,040 B/token in 16-bit,
12,240 with int8/fp8 + float32 scales (1.88× the tokens in the same memory), 7,200 with int4
(two codes per byte + a float16 scale per 16 channels: 3.2×). Per (token, KV head) the bytes
come from :meth:`llmd.quant.kv_format.KVCacheFormat.head_bytes`. Torch-free (model dtypes may be
given by name), so ``llmd kv-size`` never imports torch.

With KV cache groups (:mod:`llmd.daemon.kv.groups`) one block holds ``block_size`` tokens of
``group_size`` layers, and a sequence needs, per group, every block (full attention) or at
most the window bound (sliding window). Gemma 3 270M in 16-bit: 18,432 B/token if every
layer were global; a 32,768-token sequence needs ≈ 109 MB in the hybrid layout, 604 MB without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.kv.groups import KVCacheGroupSpec, make_kv_cache_groups
from llmd.models.config import ModelConfig
from llmd.quant.kv_format import KVCacheFormat, get_format

if TYPE_CHECKING:
    import torch

#: ``llmd kv-size`` rows: (name, ``--kv-cache-dtype``, model dtype name); bytes come from the
#: formats of :mod:`llmd.quant.kv_format` (``KVCacheFormat.head_bytes``), never a table of their own
KV_SIZE_ROWS = [("float32", "auto", "float32"), ("bf16/fp16", "auto", "bfloat16"),
                ("fp8", "fp8_e4m3", "float32"), ("int8", "int8", "float32"),
                ("int4", "int4", "float32")]


@dataclass(frozen=True)
class KVSizeRow:
    """One KV cache dtype's capacity.

    Attributes:
        name: format name.
        bytes_per_token: KV bytes per token if every layer kept every token (scales included;
            int4: the open-block residual amortized over the pool's tokens).
        bytes_per_sequence: bytes one ``context``-token sequence really holds (window bounds applied).
        num_blocks: ``floor((memory - int4 residual) / block_bytes)``.
        sequences: full-context sequences that fit, counted as the engine's startup line does:
            ``(num_blocks - 1) / blocks per sequence`` (block 0 is the reserved null block), 0
            when ``num_blocks`` is under :data:`MIN_KV_BLOCKS` (the engine refuses such a cache).
    """

    name: str
    bytes_per_token: int
    bytes_per_sequence: int
    num_blocks: int
    sequences: float


def kv_bytes_per_token(cfg: ModelConfig, element_bytes: int, scale_bytes: int = 0,
                       num_layers: int | None = None) -> int:
    """2 · layers · kv_heads · (head_dim · element_bytes + scale_bytes), in bytes
    (``num_layers`` defaults to all of the model's layers)."""
    layers = cfg.num_layers if num_layers is None else num_layers
    return 2 * layers * cfg.num_kv_heads * (cfg.head_dim * element_bytes + scale_bytes)


def kv_cache_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: "str | KVCacheFormat",
                             model_dtype: "torch.dtype | str") -> int:
    """Bytes per token of all layers in the cache ``--kv-cache-dtype`` allocates (scales included;
    a :class:`KVCacheFormat` for grouped scales);
    ``model_dtype``: a torch dtype or its name."""
    head = get_format(kv_cache_dtype).head_bytes(cfg.head_dim, model_dtype)
    return round(2 * cfg.num_layers * cfg.num_kv_heads * head)


def kv_block_bytes(cfg: ModelConfig, groups: list[KVCacheGroupSpec], block_size: int, element_bytes: int,
                   scale_bytes: int = 0) -> int:
    """Bytes of one block: ``block_size`` tokens of ``group_size`` layers (the largest group)."""
    group_size = max(len(g.layer_ids) for g in groups)
    return block_size * kv_bytes_per_token(cfg, element_bytes, scale_bytes, group_size)


def kv_cache_block_bytes(cfg: ModelConfig, groups: list[KVCacheGroupSpec], block_size: int,
                         kv_cache_dtype: "str | KVCacheFormat", model_dtype: "torch.dtype | str") -> int:
    """Bytes of one block of the cache ``--kv-cache-dtype`` allocates (scales included)."""
    group_size = max(len(g.layer_ids) for g in groups)
    head = get_format(kv_cache_dtype).block_head_bytes(cfg.head_dim, model_dtype, block_size)
    return group_size * cfg.num_kv_heads * head


def residual_slots(groups: list[KVCacheGroupSpec], max_num_seqs: int) -> int:
    """Residual slots of an int4 cache: one per (running sequence, KV cache group)."""
    return max_num_seqs * len(groups)


def kv_residual_bytes(cfg: ModelConfig, groups: list[KVCacheGroupSpec], block_size: int, kv_cache_dtype: str,
                      max_num_seqs: int) -> int:
    """Bytes of the int4 cache's open-block K residual (0 for other formats): per cache tensor
    (``group_size`` of them) :func:`residual_slots` × ``[block_size, kv_heads, head_dim]`` in 16 bits.
    It is taken from ``--kv-cache-memory`` before the blocks are counted."""
    if not get_format(kv_cache_dtype).k_per_block:
        return 0
    group_size = max(len(g.layer_ids) for g in groups)
    return group_size * residual_slots(groups, max_num_seqs) * block_size * cfg.num_kv_heads * cfg.head_dim * 2


def blocks_per_sequence(groups: list[KVCacheGroupSpec], num_tokens: int, block_size: int, chunk_size: int) -> int:
    """Most blocks one ``num_tokens``-token sequence holds at once, over all groups."""
    return sum(g.max_blocks(num_tokens, block_size, chunk_size) for g in groups)


def kv_size_rows(cfg: ModelConfig, context: int, memory: int, block_size: int, hybrid: bool = True,
                 chunk_size: int = 1, max_num_seqs: int = 64) -> list[KVSizeRow]:
    """Capacity of a ``memory``-byte KV cache for each row of :data:`KV_SIZE_ROWS`.

    Args:
        context: tokens per sequence; memory: bytes; block_size: tokens per block.
        hybrid: group sliding-window layers apart (False: every layer keeps every token).
        chunk_size: prefill chunk in tokens for the window bound (1 = decode).
        max_num_seqs: sizes int4's open-block residual (:func:`kv_residual_bytes`), which comes
            out of ``memory``; int4's bytes/token then include it, amortized over the pool's
            tokens (``(blocks · block bytes + residual) / (blocks · block_size)``).
    """
    groups = make_kv_cache_groups(cfg.layer_windows, hybrid)
    per_seq = blocks_per_sequence(groups, context, block_size, chunk_size)
    rows = []
    for name, kv_cache_dtype, model_dtype in KV_SIZE_ROWS:
        block = kv_cache_block_bytes(cfg, groups, block_size, kv_cache_dtype, model_dtype)
        residual = kv_residual_bytes(cfg, groups, block_size, kv_cache_dtype, max_num_seqs)
        blocks = max(0, memory - residual) // block
        per_token = kv_cache_bytes_per_token(cfg, kv_cache_dtype, model_dtype)
        if residual and blocks:  # the residual's share of the pool, spread over its tokens
            per_token = round(per_token * (1 + residual / (blocks * block)))
        usable = blocks - 1 if blocks >= MIN_KV_BLOCKS else 0
        rows.append(KVSizeRow(name, per_token, block * per_seq, blocks, usable / per_seq))
    return rows


#: the engine refuses a KV cache of fewer blocks (``Engine.__init__``: one of them is never handed out)
MIN_KV_BLOCKS = 2


def check_kv_memory(cfg: ModelConfig, memory: int, block_size: int, hybrids: list[bool],
                    max_num_seqs: int = 64) -> None:
    """Refuse a ``memory``-byte KV cache that holds fewer than :data:`MIN_KV_BLOCKS` blocks in
    every :data:`KV_SIZE_ROWS` format and every one of the ``hybrids`` layouts, in the engine's
    words for ``--kv-cache-memory``; the bound named is the smallest need (int4's includes its
    residual for ``max_num_seqs``). A budget some formats fit is the table's to show (their
    rows: 0 sequences).

    Raises:
        LlmdError: ``--memory 1024 B holds fewer than 2 KV blocks of 184320 B (...); give at least ...``.
    """
    need, block, name, layers = min(
        (kv_residual_bytes(cfg, groups, block_size, kv_cache_dtype, max_num_seqs) + MIN_KV_BLOCKS * block,
         block, name, max(len(g.layer_ids) for g in groups))
        for groups in (make_kv_cache_groups(cfg.layer_windows, hybrid) for hybrid in hybrids)
        for name, kv_cache_dtype, model_dtype in KV_SIZE_ROWS
        for block in [kv_cache_block_bytes(cfg, groups, block_size, kv_cache_dtype, model_dtype)])
    if memory < need:
        raise LlmdError(f"--memory {memory} B holds fewer than {MIN_KV_BLOCKS} KV blocks of any cache dtype (the "
                        f"smallest: {block} B, {block_size} tokens x {layers} layers, {name}); give at least {need} B")


def check_kv_cache_memory(config, cfg: ModelConfig, groups: list[KVCacheGroupSpec],
                          model_dtype: "torch.dtype | str", memory: int) -> tuple[int, int]:
    """Refuse a ``memory``-byte pool of the resolved engine ``config`` (its block size, cache dtype
    and --max-num-seqs) that holds fewer than :data:`MIN_KV_BLOCKS` blocks of ``groups`` (int4:
    beside its open-block residual), in the engine's words for ``--kv-cache-memory``. Shared by
    the engine (:func:`llmd.daemon.core.engine_setup.size_kv_cache`) and the check before the
    weights load (:func:`llmd.daemon.core.prompt_check.check_options_before_load`).

    Returns:
        ``(block_bytes, residual_bytes)``: one block of every group and layer; int4's residual (else 0).
    Raises:
        LlmdError: ``--kv-cache-memory 1024 B holds fewer than 2 KV blocks of 184320 B (...); give at least ...``.
    """
    block_bytes = kv_cache_block_bytes(cfg, groups, config.block_size, config.kv_format, model_dtype)
    residual_bytes = kv_residual_bytes(cfg, groups, config.block_size, config.kv_cache_dtype, config.max_num_seqs)
    if memory - residual_bytes < MIN_KV_BLOCKS * block_bytes:
        if residual_bytes:
            raise LlmdError(f"--kv-cache-memory {memory} B leaves no room for blocks beside int4's open-block "
                            f"residual ({residual_bytes} B for --max-num-seqs {config.max_num_seqs}); "
                            f"raise --kv-cache-memory or lower --max-num-seqs")
        raise LlmdError(f"--kv-cache-memory {memory} B holds fewer than {MIN_KV_BLOCKS} KV blocks of {block_bytes} B "
                        f"({config.block_size} tokens x {cfg.num_layers} layers, {config.kv_cache_dtype}); "
                        f"give at least {MIN_KV_BLOCKS * block_bytes} B")
    return block_bytes, residual_bytes


def group_summary(groups: list[KVCacheGroupSpec], block_size: int) -> str:
    """One line naming each group, its layers and (for windows) its per-sequence block bound."""
    parts = []
    for g in groups:
        bound = "" if g.sliding_window is None else f", <= {g.max_blocks(10**9, block_size, 1)} blocks/seq in decode"
        parts.append(f"{g.name} (layers {_ranges(g.layer_ids)}{bound})")
    return f"{len(groups)} KV cache group{'s' if len(groups) != 1 else ''}: " + "; ".join(parts)


def _ranges(ids: tuple[int, ...]) -> str:
    """``(0, 1, 2, 4)`` → ``"0-2,4"``."""
    out: list[str] = []
    for i in ids:
        if out and _last(out[-1]) == i - 1:
            first = out[-1].split("-")[0]
            out[-1] = f"{first}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def _last(run: str) -> int:
    return int(run.split("-")[-1])
