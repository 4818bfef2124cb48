"""Copy-on-write, forks and int4 residual slots of :class:`~llmd.daemon.kv.manager.KVCacheManager`.

A mixin: the state (``req_to_blocks``, ``pending_copies``, ``req_residual``, ...) and its
documentation are ``KVCacheManager``'s. Blocks are ``block_size`` tokens; both copy queues hold
``(src, dst)`` pairs (block ids, residual slot ids) that the runner copies before the step's forward.

* Forks: :meth:`ForkMixin.fork` gives a child (a parallel-sampling sibling, a beam, a
  disaggregation pin) the parent's block tables, sharing every block by reference count;
* copy-on-write: :meth:`ForkMixin._cow_positions` finds the shared, partly filled block the
  next token would write into, which :meth:`KVCacheManager.allocate_slots` replaces with a
  fresh copy, queued in ``pending_copies`` (:meth:`ForkMixin.take_pending_copies`). vLLM v1
  has no fork (it fans parallel sampling out into separate requests over the prefix cache);
  this follows vLLM v0's ``BlockSpaceManager.fork`` and ``CopyOnWriteTracker``
  (`vllm/core/block/common.py`);
* int4 (KIVI) residual slots: one 16-bit slot per KV cache group for each request holding
  tables (:meth:`ForkMixin.take_residual`), slot ids ``0 .. num_residual_slots - 1``; a fork
  queues ``(src slot, dst slot)`` copies in ``pending_residual_copies``.

Pure bookkeeping: nothing here touches tensors.
"""

from __future__ import annotations


class ForkMixin:
    """:class:`~llmd.daemon.kv.manager.KVCacheManager`'s forks, copy-on-write and residual
    slots; reads and sets that class's attributes."""

    def take_residual(self, request_id: str) -> bool:
        """Give a request its residual slots (one per group) if it needs them and has none;
        False (nothing taken) when too few are free."""
        if not self.num_residual_slots or request_id in self.req_residual:
            return True
        if len(self.free_residual_slots) < self.num_groups:
            return False
        self.req_residual[request_id] = [self.free_residual_slots.pop() for _ in self.groups]
        return True

    def residual_slots(self, request_id: str) -> list[int] | None:
        """The request's residual slot per group (int4 caches), or None."""
        return self.req_residual.get(request_id)

    def take_pending_residual_copies(self) -> list[tuple[int, int]]:
        """Residual (src slot, dst slot) copies queued by forks since the last call."""
        out, self.pending_residual_copies = self.pending_residual_copies, []
        return out

    def _cow_positions(self, request_id: str, num_computed_tokens: int | None) -> list[tuple[int, int]]:
        """(group, table index) of shared partly filled blocks the next token would write into."""
        tables = self.req_to_blocks.get(request_id)
        if not tables or not num_computed_tokens or num_computed_tokens % self.block_size == 0:
            return []
        i = num_computed_tokens // self.block_size
        return [(g, i) for g, t in enumerate(tables) if i < len(t) and t[i].ref_cnt > 1]

    def fork(self, parent_id: str, child_id: str, share: bool = True, residual: bool = True) -> None:
        """Give ``child_id`` the parent's block tables, sharing every block (ref count +1);
        the first append into a shared partial block copies it (parallel sampling, beams).

        ``share=False`` (the beam benchmark's baseline without sharing) gives the child fresh
        blocks instead, each queued in :attr:`pending_copies` from the parent's. Raises
        ``ValueError`` if the child has tables already, ``RuntimeError`` if the pool cannot
        hold the copies (nothing allocated then). With int4 residual slots the child gets its own,
        a copy of the parent's (``residual=False``: none, for a pin that only keeps full blocks;
        ``RuntimeError`` when none is free)."""
        if child_id in self.req_to_blocks:
            raise ValueError(f"request {child_id!r} already has block tables")
        parent_res = self.req_residual.get(parent_id) if residual else None
        if parent_res is not None and len(self.free_residual_slots) < self.num_groups:
            raise RuntimeError(f"no free int4 residual slot for {child_id!r}")
        tables = [list(t) for t in self.req_to_blocks[parent_id]]
        if not share:
            real = [(g, i) for g, t in enumerate(tables) for i, b in enumerate(t) if not b.is_null]
            if len(real) > self.num_free_blocks:
                raise RuntimeError(f"copying {len(real)} blocks for {child_id!r}: only {self.num_free_blocks} free")
            for (g, i), new in zip(real, self.block_pool.get_new_blocks(len(real))):
                self.pending_copies.append((tables[g][i].block_id, new.block_id))
                tables[g][i] = new
        else:
            for t in tables:
                self.block_pool.touch(t)
        if parent_res is not None:
            self.take_residual(child_id)
            self.pending_residual_copies.extend(zip(parent_res, self.req_residual[child_id]))
        self.req_to_blocks[child_id] = tables
        if parent_id in self.shifted:
            self.shifted.add(child_id)
        for d in (self.req_extra, self.req_block_hashes, self.num_cached_block, self.req_keep_blocks):
            if parent_id in d:
                d[child_id] = list(d[parent_id]) if isinstance(d[parent_id], list) else d[parent_id]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs queued since the last call (the runner copies
        each block's K/V and scales in every cache tensor before the step's forward)."""
        out, self.pending_copies = self.pending_copies, []
        return out
