"""The engine outside the serving loop: teacher forcing (``llmd bench kv-quality``: every
position's logits ``[len(ids), vocab]`` float32 through the paged cache, the scheduler
bypassed) and :meth:`~OfflineMixin.generate` (prompts run to completion, for tests and
benchmarks).

:class:`OfflineMixin` is a base of :class:`~llmd.daemon.core.engine.Engine`; it uses the
engine's ``kv_manager`` and ``runner`` (teacher forcing) and its ``add_request`` / ``step``
(generate).
"""

from __future__ import annotations

import torch

from llmd.daemon.core.request import SamplingParams


class OfflineMixin:
    """Teacher forcing and ``generate`` of :class:`~llmd.daemon.core.engine.Engine` (see the module
    docstring)."""

    # ---- teacher forcing (``llmd bench kv-quality``) ----------------------------------
    def teacher_forced_logits(self, ids: list[int], chunk: int = 64, cached_prefix: int = 0) -> torch.Tensor:
        """Logits of every position of ``ids``, prefilled ``chunk`` tokens per step through the
        paged cache (store-then-read), outside the scheduler (nothing else may be running).

        ``cached_prefix`` > 0 serves the prefix from the prefix cache: a first sequence computes
        ``ids[:cached_prefix]`` and leaves its full blocks cached; the sequence of all of ``ids``
        then looks its prefix up as the scheduler does at admission, shares those blocks
        (prefix cache hit) and computes only the rest, in the same chunk boundaries when
        ``cached_prefix`` is a multiple of ``chunk``. The logits are the first sequence's
        followed by the second's.

        Returns:
            ``[len(ids), vocab]`` float32 (CPU).
        Raises:
            RuntimeError: the pool cannot hold ``ids``, or (``cached_prefix``) prefix caching is
                off or the lookup hit fewer than the prefix's full blocks.
        """
        mgr = self.kv_manager
        if not cached_prefix:
            return self._teacher_forced_chunks("kv-quality", ids, 0, [], chunk)
        if not mgr.enable_caching:
            raise RuntimeError("cached_prefix needs prefix caching (enable_prefix_caching)")
        head = self._teacher_forced_chunks("kv-quality-prefix", ids[:cached_prefix], 0, [], chunk, cache=True)
        hit, blocks = mgr.get_computed_blocks("kv-quality", ids, len(ids))
        want = cached_prefix // mgr.block_size * mgr.block_size
        if hit != want:
            raise RuntimeError(f"prefix cache hit {hit} tokens, expected {want}")
        return torch.cat([head[:hit], self._teacher_forced_chunks("kv-quality", ids, hit, blocks, chunk)])

    def _teacher_forced_chunks(self, rid: str, ids: list[int], start: int, hit_blocks: list, chunk: int,
                               cache: bool = False) -> torch.Tensor:
        """Logits ``[len(ids) - start, vocab]`` of positions ``start..``: ``start`` tokens are
        prefix cache hits (``hit_blocks`` from ``get_computed_blocks``), the rest computed in
        ``chunk``s. ``cache``: register the full blocks in the prefix cache before freeing them."""
        mgr = self.kv_manager
        if mgr.allocate_slots(rid, len(ids), start or None, hit_blocks if start else None) is None:
            raise RuntimeError(f"KV pool too small for {len(ids)} tokens")
        try:
            tables = mgr.get_block_tables(rid)
            res = mgr.residual_slots(rid)
            out = [self.runner.prefill_logits(rid, ids[pos : pos + chunk], pos, tables, res)
                   for pos in range(start, len(ids), chunk)]
            if cache:
                mgr.cache_blocks(rid, ids, len(ids))
            return torch.cat(out)
        finally:
            mgr.free(rid)

    # ---- to completion (tests, benchmarks) -------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        """Run prompts to completion (tests, benchmarks). Returns per prompt a dict with
        ``token_ids``, ``text``, ``finish_reason``, in prompt order."""
        plist = params if isinstance(params, list) else [SamplingParams(**vars(params)) for _ in prompts]
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        results = {i: {"token_ids": [], "text": "", "finish_reason": None} for i in ids}
        while self.has_unfinished_requests():
            for o in self.step():
                r = results[o.request_id]
                r["token_ids"] += o.new_token_ids
                r["text"] += o.new_text
                r["finish_reason"] = o.finish_reason
        return [results[i] for i in ids]
