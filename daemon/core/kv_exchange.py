"""The engine's side of prefill/decode disaggregation (engine thread only).

Producer (``kv_transfer_params.do_remote_decode``): a request submitted with ``kv_export =
(transfer_id, ttl_s)`` keeps its blocks when it finishes: the scheduler pins them under a
private id (:func:`llmd.daemon.kv.transfer.pin_blocks`, a fork: ref counts), and
:meth:`KVExchange.on_finished` records the pin under the transfer id with a deadline and
returns what the response's ``kv_transfer_params`` need (the block ids). The pin ends once:
pulled (:meth:`export`: the blocks are copied into a :class:`KVPayload`, then freed), expired
(:meth:`expire`, called by the engine loop every iteration), or at shutdown. Only the
transfer id finds a pin, never block ids: blocks of another request (another ``cache_salt``)
cannot be read through the pull.

Consumer (``do_remote_prefill``): a request submitted with ``kv_import = payload`` is checked
against this engine (:meth:`accept`: same fingerprint, same prompt, the ranges this engine
would keep); on any mismatch it computes its prefill itself and the reason is logged and
counted. Accepted, the scheduler admits it with ``P - 1`` tokens computed
(:func:`llmd.daemon.kv.transfer.allocate_imported`) and :meth:`apply` writes the payload into
its blocks before the step's forward, which computes the last prompt token only (int4: the
full blocks' tokens computed, the last block's 1 to ``block_size`` tokens recomputed, since its
16-bit residual does not travel; :func:`~llmd.daemon.kv.transfer.imported_tokens`).

Counters (``/v1/stats`` ``kv_transfer``): pins made / pulled / expired / live, blocks and bytes
exported; requests imported, tokens imported, blocks and bytes imported, recomputed (by reason
class: ``mismatch`` (fingerprint, prompt or ranges differ), ``pull_failed``, ``no_producer``
(params without a producer address or transfer id)).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from llmd.daemon.core.errors import LlmdError, RequestError
from llmd.daemon.core.kv_transfer import (
    KVPayload,
    fingerprint_mismatch,
    gather_blocks,
    kv_fingerprint,
    scatter_blocks,
    token_digest,
)
from llmd.daemon.kv.transfer import import_ranges, imported_block_ids, imported_tokens, pin_id_of, pinned_block_ids

log = logging.getLogger("llmd.kv_transfer")


class KVTransferError(LlmdError):
    """A pull that cannot be served: unknown, expired or already pulled transfer id, or pinned
    blocks that no longer cover the prompt."""


@dataclass
class Pin:
    """One producer request's pinned blocks.

    Attributes:
        request: the finished request (its prompt ids, seed for test faults).
        pin_id: the KV manager's id of the pin's tables.
        ranges: per group, the table indices ``[first, end)`` a consumer imports.
        block_ids: per group, the block ids of those ranges.
        expires_at: ``time.monotonic()`` deadline (seconds).
    """

    request: object
    pin_id: str
    ranges: list[tuple[int, int]]
    block_ids: list[list[int]]
    expires_at: float


class KVExchange:
    """Pins, exports and imports of one :class:`~llmd.daemon.core.engine.Engine` (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.pins: dict[str, Pin] = {}  # transfer id → pin
        self.counters: Counter[str] = Counter()
        self._fingerprint: dict | None = None

    @property
    def fingerprint(self) -> dict:
        """:func:`kv_fingerprint` of this engine (computed once)."""
        if self._fingerprint is None:
            self._fingerprint = kv_fingerprint(self.engine)
        return self._fingerprint

    @property
    def full_blocks_only(self) -> bool:
        """int4 (KIVI): the open block's K lives in a residual slot that does not travel, so only
        the full blocks are imported and the last block's tokens recomputed
        (:func:`llmd.daemon.kv.transfer.imported_tokens`)."""
        return self.engine.kv_manager.num_residual_slots > 0

    def _ranges(self, num_prompt_tokens: int) -> list[tuple[int, int]]:
        return import_ranges(self.engine.kv_cache_groups, num_prompt_tokens, self.engine.config.block_size,
                             self.full_blocks_only)

    # ---- producer ------------------------------------------------------------------
    def on_finished(self, req) -> dict | None:
        """Record a finished ``kv_export`` request's pin; returns ``{"remote_block_ids",
        "remote_request_id", "expires_in_s", "fingerprint"}`` for the response, or None (nothing pinned: it
        was not an export, ended by abort or error, or its prompt has < 2 tokens)."""
        export = getattr(req, "kv_export", None)
        if export is None:
            return None
        transfer_id, ttl_s = export
        req.kv_export = None
        kv, pin_id = self.engine.kv_manager, pin_id_of(req.request_id)
        if pin_id not in kv.req_to_blocks:
            return None
        try:
            ranges = self._ranges(req.num_prompt_tokens)
            block_ids = pinned_block_ids(kv, pin_id, ranges)
        except ValueError as e:
            log.warning("not pinning the KV of %s: %s", req.request_id, e)
            kv.free(pin_id)
            return None
        self.pins[transfer_id] = Pin(req, pin_id, ranges, block_ids, time.monotonic() + ttl_s)
        self.counters["pinned"] += 1
        return {"remote_block_ids": block_ids[0] if len(block_ids) == 1 else block_ids,
                "remote_request_id": req.request_id, "expires_in_s": ttl_s, "fingerprint": self.fingerprint}

    def export(self, transfer_id: str) -> tuple[KVPayload, tuple[str, float] | None]:
        """Copy a pin's blocks into a :class:`KVPayload` and free the pin (one pull per pin).

        Returns:
            ``(payload, fault)``: ``fault`` is ``(kind, value)`` of a test fault the pull must
            act out (``kv_pull_cut``, ``kv_pull_stall``; :mod:`.faults`), else None.
        Raises:
            KVTransferError: no live pin has this transfer id (never pinned, expired, pulled).
        """
        pin = self.pins.pop(transfer_id, None)
        if pin is None:
            raise KVTransferError("no pinned KV for this transfer id (unknown, expired or already pulled)")
        eng, fault = self.engine, None
        try:
            injected = eng.faults.kv_pull_fault(pin.request) if eng.faults is not None else None
            if injected is not None and injected.kind == "kv_expire":
                self.counters["expired"] += 1
                raise KVTransferError("no pinned KV for this transfer id (expired: injected fault)")
            fault = None if injected is None else (injected.kind, injected.value)
            data, scales = gather_blocks(eng.runner.caches, pin.block_ids)
        finally:
            eng.kv_manager.free(pin.pin_id)
        req = pin.request
        payload = KVPayload(req.num_prompt_tokens, token_digest(req.prompt_token_ids), self.fingerprint,
                            pin.ranges, data, scales)
        self.counters["pulled"] += 1
        self.counters["exported_blocks"] += payload.num_blocks
        self.counters["exported_bytes"] += payload.nbytes
        return payload, fault

    def expire(self, now: float | None = None) -> int:
        """Free the pins past their deadline; returns how many."""
        now = time.monotonic() if now is None else now
        gone = [tid for tid, pin in self.pins.items() if pin.expires_at <= now]
        for tid in gone:
            pin = self.pins.pop(tid)
            self.engine.kv_manager.free(pin.pin_id)
            log.info("pinned KV of %s expired unpulled", pin.request.request_id)
        self.counters["expired"] += len(gone)
        return len(gone)

    def release_all(self) -> None:
        """Free every pin (the engine loop stops)."""
        for pin in self.pins.values():
            self.engine.kv_manager.free(pin.pin_id)
        self.pins.clear()

    # ---- either side: a request being added ------------------------------------------
    def attach(self, reqs: list, kv_export: tuple[str, float] | None, kv_import: KVPayload | None,
               kv_fallback: tuple[str, str] | None) -> None:
        """Mark a new request's sequences (``Engine.add_parallel_request``): ``kv_export`` pins
        its prompt's KV when it finishes; ``kv_import`` is checked by :meth:`accept`;
        ``kv_fallback`` is ``(kind, reason)`` when a consumer did not pull (counted as
        ``recomputed_<kind>`` and logged: it computes the prefill).

        Raises:
            RequestError: ``kv_export`` or ``kv_import`` on more than one sequence (``param``
                ``kv_transfer_params``).
        """
        if (kv_export is not None or kv_import is not None) and len(reqs) != 1:
            raise RequestError(f"kv_transfer_params needs a single sequence, got n = {len(reqs)}",
                               "kv_transfer_params")
        req = reqs[0]
        req.kv_export = kv_export
        if kv_import is not None:
            self.accept(req, kv_import)
        elif kv_fallback is not None:
            self.recomputed(req.request_id, *kv_fallback)

    def apply_scheduled(self, reqs: dict) -> None:
        """Before a step's forward: write the pulled KV of the requests it admitted with one
        (``reqs``: the step's requests by id) into their new blocks."""
        for rid, req in reqs.items():
            if req.kv_import is not None:
                self.apply(req, imported_block_ids(self.engine.kv_manager, rid, req.kv_import.ranges))

    # ---- consumer ------------------------------------------------------------------
    def accept(self, req, payload: KVPayload) -> str | None:
        """Attach ``payload`` to ``req`` (``req.kv_import``) if it fits this engine and prompt;
        else return why not (the request then computes its prefill; counted and logged)."""
        reason = fingerprint_mismatch(self.fingerprint, payload.fingerprint)
        if reason is None and payload.num_prompt_tokens != req.num_prompt_tokens:
            reason = f"the producer's prompt has {payload.num_prompt_tokens} tokens, this one {req.num_prompt_tokens}"
        if reason is None and payload.token_digest != token_digest(req.prompt_token_ids):
            reason = "the producer's prompt tokens differ from this request's"
        if reason is None and payload.num_prompt_tokens >= 2 and payload.ranges != self._ranges(req.num_prompt_tokens):
            reason = f"block ranges {payload.ranges} differ from this engine's {self._ranges(req.num_prompt_tokens)}"
        if reason is None:
            payload.computed_tokens = imported_tokens(payload.num_prompt_tokens, self.engine.config.block_size,
                                                      self.full_blocks_only)
            req.kv_import = payload
            return None
        self.recomputed(req.request_id, "mismatch", reason)
        return reason

    def recomputed(self, request_id: str, kind: str, reason: str) -> None:
        """Count and log a request that computes its own prefill instead of importing it."""
        self.counters[f"recomputed_{kind}"] += 1
        log.warning("request %s computes its prefill itself (KV not imported): %s", request_id, reason)

    def apply(self, req, block_ids: list[list[int]]) -> None:
        """Write ``req.kv_import`` into its new blocks ``block_ids`` (per group), before the
        forward of the step that admitted it; then drop the payload."""
        payload, req.kv_import = req.kv_import, None
        scatter_blocks(self.engine.runner.caches, block_ids, payload)
        self.counters["imported"] += 1
        self.counters["imported_tokens"] += payload.num_computed_tokens
        self.counters["imported_blocks"] += payload.num_blocks
        self.counters["imported_bytes"] += payload.nbytes

    def stats(self) -> dict:
        """The ``kv_transfer`` counters of ``/v1/stats`` (``pins_live`` included)."""
        keys = ("pinned", "pulled", "expired", "exported_blocks", "exported_bytes", "imported", "imported_tokens",
                "imported_blocks", "imported_bytes", "recomputed_mismatch", "recomputed_pull_failed",
                "recomputed_no_producer")
        return {**{k: self.counters[k] for k in keys}, "pins_live": len(self.pins)}
