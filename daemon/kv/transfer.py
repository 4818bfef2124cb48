"""Block bookkeeping of prefill/decode disaggregation: which blocks of a prompt a decode
instance needs, pinning them on the producer, and allocating them on the consumer.

vLLM's NixlConnector splits a request between a prefill instance (the *producer* of the KV)
and a decode instance (the *consumer*): the producer computes the prompt and keeps its blocks
until the consumer has pulled them; the consumer allocates blocks, fills them with the
pulled K/V and marks those tokens computed (``num_computed_tokens``), so it computes only the
last prompt token (to get logits to sample from) and then decodes.

What a consumer needs, per KV cache group, for a prompt of ``P`` tokens whose first ``P - 1``
are imported: the blocks covering tokens ``[0, P)`` (the last one is recomputed, store-then-
read, so it must have a slot), minus, in a sliding-window group of window ``W``, the blocks no
query at position ``>= P - 1`` can see: those whose last token is ``< P - W`` (the rule of
:meth:`KVCacheManager.remove_skipped_blocks` with ``num_computed_tokens = P - 1``). Both sides
compute this range with :func:`first_kept_block` and :func:`num_table_blocks`, so a consumer
never receives a block it would drop at once.

int4 (KIVI) caches keep each sequence's open block's K in a 16-bit residual slot
(:class:`KVCacheManager` ``num_residual_slots``), not in its block. Such a pair transfers the
blocks only: the consumer imports the full blocks before the last prompt token's block, i.e.
``imported_tokens = ((P - 1) // block_size) · block_size`` tokens, and recomputes the last block's
``P - imported_tokens`` (1 to ``block_size``) tokens itself, as after a prefix-cache hit, which
rebuilds their residual (:func:`imported_tokens`; the sliding-window ranges start at what a query
at ``imported_tokens`` still sees). The last block's bytes still travel (the ranges are the same
shape) and are rewritten by that recompute.

Pinning is a fork under a private id (:func:`pin_blocks`): the pin holds one reference to each
block like a request's table does, so ``check_integrity()`` holds throughout and freeing the
pin (:meth:`KVCacheManager.free`) is the one way back to the pool.

Pure bookkeeping: nothing here touches tensors.
"""

from __future__ import annotations

from .groups import KVCacheGroupSpec
from .manager import KVCacheManager
from .prefix_cache import extra_keys

PIN_PREFIX = "kv-pin:"


def pin_id_of(request_id: str) -> str:
    """The KV manager id under which a finished request's blocks stay pinned."""
    return PIN_PREFIX + request_id


def imported_block_ids(manager: KVCacheManager, request_id: str, ranges: list[tuple[int, int]]) -> list[list[int]]:
    """Block ids of ``request_id``'s tables in ``ranges`` (one ``[first, end)`` per group)."""
    return [[b.block_id for b in t[first:end]] for t, (first, end) in zip(manager.req_to_blocks[request_id], ranges)]


def first_kept_block(group: KVCacheGroupSpec, num_computed_tokens: int, block_size: int) -> int:
    """Index of the first block of ``group``'s table that a query at position
    ``num_computed_tokens`` (or later) can still see: 0 for full attention, else
    ``max(0, num_computed_tokens - W + 1) // block_size`` (earlier ones are null blocks)."""
    if group.sliding_window is None:
        return 0
    return max(0, num_computed_tokens - group.sliding_window + 1) // block_size


def num_table_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks a table needs to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def imported_tokens(num_prompt_tokens: int, block_size: int, full_blocks_only: bool = False) -> int:
    """Prompt tokens a consumer marks computed from the pulled KV: ``P - 1`` (the last is
    recomputed for its logits), or with ``full_blocks_only`` (int4's open-block residual does not
    travel) the tokens of the full blocks before the last prompt token's block,
    ``((P - 1) // block_size) · block_size``."""
    n = num_prompt_tokens - 1
    return n - n % block_size if full_blocks_only else n


def import_ranges(groups: list[KVCacheGroupSpec], num_prompt_tokens: int, block_size: int,
                  full_blocks_only: bool = False) -> list[tuple[int, int]]:
    """Per group, the table indices ``[first, end)`` whose K/V a consumer imports for a prompt of
    ``num_prompt_tokens`` tokens (the first :func:`imported_tokens` computed elsewhere; see the
    module docstring). Raises ``ValueError`` for a prompt of fewer than 2 tokens (nothing to import)."""
    if num_prompt_tokens < 2:
        raise ValueError(f"a prompt of {num_prompt_tokens} token(s) has no KV to import (need >= 2)")
    end = num_table_blocks(num_prompt_tokens, block_size)
    computed = imported_tokens(num_prompt_tokens, block_size, full_blocks_only)
    return [(first_kept_block(g, computed, block_size), end) for g in groups]


def pin_blocks(manager: KVCacheManager, request_id: str, pin_id: str) -> bool:
    """Give ``pin_id`` one more reference to every block of ``request_id``'s tables (a fork), so
    they outlive the request. Returns False (nothing pinned) when the request holds no tables.
    Raises ``ValueError`` if ``pin_id`` already holds tables."""
    if request_id not in manager.req_to_blocks:
        return False
    manager.fork(request_id, pin_id, residual=False)
    return True


def pinned_block_ids(manager: KVCacheManager, pin_id: str, ranges: list[tuple[int, int]]) -> list[list[int]]:
    """The block ids of ``pin_id``'s tables in ``ranges`` (one ``[first, end)`` per group).

    Raises:
        KeyError: nothing is pinned under ``pin_id``.
        ValueError: a table is too short, or holds the null block inside its range (a sliding
            window dropped a block the consumer needs: the producer generated past the prompt).
    """
    tables = manager.req_to_blocks[pin_id]
    out = []
    for g, (table, (first, end)) in enumerate(zip(tables, ranges)):
        if len(table) < end:
            raise ValueError(f"group {g} holds {len(table)} blocks, the prompt needs {end}")
        blocks = table[first:end]
        if any(b.is_null for b in blocks):
            raise ValueError(f"group {g} dropped a block in [{first}, {end}) (out of its sliding window)")
        out.append([b.block_id for b in blocks])
    return out


def allocate_imported(manager: KVCacheManager, request_id: str, num_tokens: int, ranges: list[tuple[int, int]],
                      cache_salt: str | None = None) -> list[list[int]] | None:
    """Start ``request_id``'s tables for ``num_tokens`` tokens whose K/V (the blocks in
    ``ranges``) arrive from another instance: each group's table is ``first`` null blocks, then
    fresh blocks up to ``ceil(num_tokens / block_size)``. All or nothing across groups (and, with
    int4 residual slots, the request's slots: none free is None, nothing allocated).

    ``cache_salt`` sets the request's block-hash extra keys, as a prefix lookup would, so its
    blocks are registered in the prefix cache under the right salt once full.

    Returns:
        The new block ids of the imported ranges, one list per group, or None (nothing
        allocated) when the pool has too few free blocks.
    Raises:
        ValueError: the request has tables already, a range does not end at the table size,
            or a full-attention group's range does not start at 0 (it has no null blocks).
    """
    if request_id in manager.req_to_blocks:
        raise ValueError(f"request {request_id!r} already has block tables")
    end = num_table_blocks(num_tokens, manager.block_size)
    for spec, (first, stop) in zip(manager.groups, ranges):
        if stop != end or not 0 <= first < end or (first and spec.sliding_window is None):
            raise ValueError(f"import range [{first}, {stop}) does not fit a {spec.name} table of {end} blocks")
    if sum(stop - first for first, stop in ranges) > manager.num_free_blocks:
        return None
    if not manager.take_residual(request_id):
        return None
    pool = manager.block_pool
    tables = [[pool.null_block] * first + pool.get_new_blocks(stop - first) for first, stop in ranges]
    manager.req_to_blocks[request_id] = tables
    manager.req_extra[request_id] = extra_keys(manager.model_id, manager.kv_cache_dtype, cache_salt)
    manager.req_block_hashes.pop(request_id, None)
    return [[b.block_id for b in t[first:]] for t, (first, _) in zip(tables, ranges)]
