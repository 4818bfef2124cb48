"""Iteration-level (continuous) batching scheduler with chunked prefill and preemption.

Every step (Orca, Yu et al. OSDI'22; vLLM v1 ``vllm/v1/core/sched/scheduler.py``):

1. running requests are scheduled first, decodes (one token each) before prefill chunks, so
   a long prompt arriving never stalls the others' tokens; a prefill chunk is at most
   ``max_prefill_chunk`` tokens and the whole step at most ``max_num_batched_tokens``;
2. blocks are allocated as tokens arrive (sliding-window groups free what fell out of their
   window). When the pool runs dry, the scheduler preempts by recompute: the victim is the
   running request with the largest ``priority`` value, then the latest arrival; its blocks
   are freed (full ones stay in the prefix cache), it goes to the front of its priority class
   in the waiting queue, and when resumed it recomputes prompt + generated tokens (mostly
   prefix-cache hits) and continues exactly where it stopped;
3. if nothing was preempted, waiting requests join in priority order (FCFS among equals)
   while the budget, ``max_num_seqs`` and the pool allow; each is looked up in the prefix
   cache when admitted. A waiting request whose next uncached block a running request is
   computing right now (the same chain hash: chats arriving on one system prompt while the
   first of them is still prefilling it) stays waiting, and those behind it may go ahead,
   until that block is cached: it then starts from a longer hit instead of computing the same
   prefix a second time (SGLang's in-batch prefix caching check makes the same call). On the
   peers' shared-prefix workload over HTTP, the second chat arrived during the first's first
   chunk and recomputed ~500 prompt tokens beside it (README "Prefix caching"). It waits only
   when at least ``PREFIX_WAIT_MIN_BLOCKS`` blocks in a row from its next one are in flight: a
   shorter run (chats whose questions start alike, one block past the system prompt) costs less
   to compute twice than a step's wait; on that workload 21 of 32 chats waited a whole step
   (~0.9 s of TTFT) for one 16-token block each.

Priorities count only under ``scheduling_policy="priority"`` (vLLM's ``--scheduling-policy``);
under the default ``"fcfs"`` every request has priority 0, so the order above is arrival order
and the victim the latest arrival, and a request with another ``priority`` is refused (as vLLM
refuses one without the policy).

A request that could never fit alone (its peak blocks over all KV cache groups above the
pool) is rejected up front, and the waiting queue is bounded (``max_num_waiting``). The
siblings of a parallel-sampling request wait, fork and inherit by the policy of
:mod:`llmd.daemon.core.parallel`. The scheduler returns plain data (:mod:`.outputs`) and never
touches tensors.

The class is split by responsibility: the step (``schedule``, preemption) here; admission,
the waiting queue's order and release in :mod:`llmd.daemon.core.scheduler_admission`
(:class:`AdmissionMixin`); the update after a step and the stop checks in
:mod:`llmd.daemon.core.scheduler_update` (:class:`UpdateMixin`).
"""

from __future__ import annotations

from collections import deque

from llmd.daemon.core import context_shift
from llmd.daemon.core.outputs import BlockShift, ResidualShift, ScheduledRequest, SchedulerOutput
from llmd.daemon.core.request import Request, RequestStatus
from llmd.daemon.core.scheduler_admission import AdmissionMixin
from llmd.daemon.core.scheduler_update import UpdateMixin
from llmd.daemon.kv import KVCacheManager
from llmd.daemon.kv.transfer import allocate_imported

PREFIX_WAIT_MIN_BLOCKS = 4  # in-flight blocks in a row worth waiting a step for (module docstring, 3.)


class Scheduler(AdmissionMixin, UpdateMixin):
    """Decides which requests run each step and how many tokens each computes.

    Args:
        kv_cache_manager: owner of the block tables.
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens per step at most (the token budget).
        max_model_len: context cap in tokens; generation stops at it (finish_reason "length").
        max_prefill_chunk: prefill tokens of one request per step at most (None: the budget).
        max_num_waiting: waiting requests at most (None: unbounded); preempted ones always re-enter.
        scheduling_policy: "fcfs" (non-zero priorities refused) or "priority".
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_prefill_chunk: int | None = None, max_num_waiting: int | None = None,
                 scheduling_policy: str = "fcfs"):
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.max_num_waiting = max_num_waiting
        self.scheduling_policy = scheduling_policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # total preemptions that freed blocks
        self.num_context_shifts = 0  # context shifts done (in place or by recompute)
        self.pending_shifts: list = []  # (request_id, BlockShift | ResidualShift) for the next step's runner

    # ---- one step -----------------------------------------------------------------
    def _scheduled(self, req: Request, start: int, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_ids_slice(start, start + num_new),
            num_computed_tokens=start,
            block_tables=self.kv.get_block_tables(req.request_id),
            sample=start + num_new == req.num_tokens,
            is_prefill=start < req.num_prompt_tokens,
            residual_slots=self.kv.residual_slots(req.request_id),
        )

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        return min(remaining, budget) if remaining == 1 else min(remaining, budget, self.max_prefill_chunk)

    def _preempt(self, victim: Request) -> None:
        """Free the victim's blocks (full ones stay cached) and queue it in front of its
        priority class; it recomputes from the prefix cache when resumed."""
        held = self.kv.num_blocks_held(victim.request_id)
        self._requeue(victim)
        if held:  # the counter moves only when blocks were actually freed
            victim.num_preemptions += 1
            self.num_preemptions += 1

    def _requeue(self, req: Request) -> None:
        """Free a running request's blocks and put it in front of its priority class, to
        recompute from ``num_computed_tokens`` 0 (preemption; a context shift by recompute)."""
        self.kv.free(req.request_id)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self._enqueue(req, front=True)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests (see the module docstring for the order and preemption)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running
                   if r.num_tokens - r.num_computed_tokens == 1 and r.num_computed_tokens >= r.num_prompt_tokens]
        decode_ids = {id(r) for r in decodes}
        chunks = [r for r in self.running if id(r) not in decode_ids]
        preempted = False
        for req in decodes + chunks:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING or req.num_computed_tokens >= req.num_tokens:
                continue  # preempted earlier in this step, or a beam waiting for its siblings (beam.py)
            num_new = self._num_new_tokens(req, budget)
            start = req.num_computed_tokens
            while self.kv.allocate_slots(req.request_id, start + num_new, start) is None:
                victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                done = next((s for s in out.scheduled if s.request_id == victim.request_id), None)
                if done is not None:  # un-schedule it: nothing has run yet
                    out.scheduled.remove(done)
                    budget += done.num_new_tokens
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.scheduled.append(self._scheduled(req, start, num_new))
                budget -= num_new
        in_flight = self._blocks_in_flight() if self.waiting and budget > 0 and not preempted else set()
        i = 0  # waiting[i] is next; the ones before it wait for a prefix being computed
        while i < len(self.waiting) and budget > 0 and not preempted:
            req = self.waiting[i]
            if len(self.running) + 1 + len(req.followers) > self.max_num_seqs:
                break
            # look the prefix up now, when it is admitted (never a stale count); a resumed
            # request looks up everything it knows (prompt + generated tokens)
            if context_shift.shifts(req):
                self.kv.req_keep_blocks[req.request_id] = context_shift.keep_blocks(req, self.kv.block_size)
            imported = req.kv_import is not None  # its prompt's KV was computed elsewhere (kv_exchange.py)
            if imported:
                num_cached, blocks = req.kv_import.num_computed_tokens, None
            else:
                num_cached, blocks = self.kv.get_computed_blocks(
                    req.request_id, req.all_token_ids, req.num_tokens, req.cache_salt)
            if not imported and self.kv.in_flight_run(req.request_id, req.num_prompt_tokens, num_cached,
                                                      in_flight) >= PREFIX_WAIT_MIN_BLOCKS:
                i += 1  # a running request is computing its next blocks: it waits for the hit
                continue
            req.num_computed_tokens = num_cached
            num_new = self._num_new_tokens(req, budget)
            if imported:
                allocated = allocate_imported(self.kv, req.request_id, num_cached + num_new, req.kv_import.ranges,
                                              req.cache_salt)
            else:
                allocated = self.kv.allocate_slots(req.request_id, num_cached + num_new, num_cached, blocks)
            if allocated is None:
                req.num_computed_tokens = 0
                if not out.scheduled and self._preempt_waiting_beams():
                    continue  # only beams waiting for a sibling held the blocks: they recompute later
                break  # head-of-line: priority/FCFS order is kept
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
                if not imported:  # pulled KV is no prefix-cache hit
                    self.kv.record_prefix_lookup(req.num_prompt_tokens, num_cached)
            del self.waiting[i]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, num_cached, num_new))
            budget -= num_new
            if not imported:  # its prompt blocks are in flight now for those behind it
                in_flight.update(self.kv.uncomputed_block_hashes(req.request_id, num_cached))
        out.blocks_to_copy = self.kv.take_pending_copies()
        out.residual_copies = self.kv.take_pending_residual_copies()
        if self.pending_shifts:  # those of requests preempted or finished since are dropped
            live = [op for rid, op in self.pending_shifts if rid in self.kv.req_to_blocks]
            out.blocks_to_shift = [op for op in live if isinstance(op, BlockShift)]
            out.residuals_to_shift = [op for op in live if isinstance(op, ResidualShift)]
            self.pending_shifts = []
        return out

    def _blocks_in_flight(self) -> set[bytes]:
        """Chain hashes of the prompt blocks running requests are still to compute (their
        prefill chunks, this step's included): a waiting request whose next block is one of
        them waits for it to be cached (module docstring, 3.)."""
        out: set[bytes] = set()
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                out.update(self.kv.uncomputed_block_hashes(r.request_id, r.num_computed_tokens))
        return out

    def _preempt_waiting_beams(self) -> bool:
        """Preempt the running beams that wait, with nothing to compute, for a preempted
        sibling (:mod:`.beam`) when nothing else can run: otherwise their blocks could keep
        the waiting queue's head out for good. Returns whether any was preempted."""
        held = [r for r in self.running if r.num_computed_tokens >= r.num_tokens]
        for r in held:
            self._preempt(r)
        return bool(held)
