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
"""

from __future__ import annotations

from collections import deque

from llmd.daemon.core import context_shift
from llmd.daemon.core.errors import QueueFullError, RequestError
from llmd.daemon.core.outputs import BlockShift, ResidualShift, ScheduledRequest, SchedulerOutput
from llmd.daemon.core.parallel import attach_followers, drop_follower, fork_followers, promote_heir
from llmd.daemon.core.request import Request, RequestStatus
from llmd.daemon.kv import KVCacheManager
from llmd.daemon.kv.transfer import allocate_imported, pin_blocks, pin_id_of

PREFIX_WAIT_MIN_BLOCKS = 4  # in-flight blocks in a row worth waiting a step for (module docstring, 3.)


class Scheduler:
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

    # ---- admission ----------------------------------------------------------------
    def max_tokens_of(self, req: Request) -> int:
        """Most tokens ``req`` can reach: prompt + max_tokens (max_tokens resolved by the engine),
        at most ``max_model_len`` (a context-shifting request runs past it in a shorter context)."""
        return min(req.num_prompt_tokens + req.sampling_params.max_tokens, self.max_model_len)

    def peak_blocks(self, req: Request) -> int:
        """Most blocks one sequence of ``req`` can hold at once, summed over KV cache groups
        (full attention: every block; sliding windows: the window bound for a chunk, plus the
        kept head of a context-shifting request)."""
        n, bs = self.max_tokens_of(req), self.kv.block_size
        keep = context_shift.keep_blocks(req, bs) if context_shift.shifts(req) else 0
        return sum(g.max_blocks(n, bs, self.max_prefill_chunk) + (keep if g.sliding_window else 0)
                   for g in self.kv.groups)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        """Insert into the waiting queue by priority (lower first): behind its equals, or in
        front of them (``front``, for preempted requests)."""
        p = req.priority
        i = next((k for k, w in enumerate(self.waiting) if (w.priority >= p if front else w.priority > p)),
                 len(self.waiting))
        self.waiting.insert(i, req)

    def add_request(self, req: Request, followers: list[Request] | tuple = ()) -> None:
        """Queue a request. Its ``sampling_params.max_tokens`` must already be resolved.

        ``followers`` are parallel-sampling siblings with the same prompt: they wait until
        ``req`` has computed the prompt, then fork its blocks (the prompt is prefilled once)
        and sample their first token from the same logits.

        Raises:
            QueueFullError: the waiting queue is full.
            RequestError: an id is already live, or one sequence can never fit in the KV pool
                (``param`` "max_tokens"), or ``n`` exceeds ``max_num_seqs`` (``param`` "n"), or a
                non-zero priority under the "fcfs" policy (``param`` "priority").
        """
        if req.priority != 0 and self.scheduling_policy != "priority":
            raise RequestError(f"priority {req.priority} needs a daemon started with --scheduling-policy priority "
                               f"(this one schedules {self.scheduling_policy})", "priority")
        group = [req, *followers]
        for r in group:
            if r.request_id in self.requests or sum(x.request_id == r.request_id for x in group) > 1:
                raise RequestError(f"request id {r.request_id!r} is already in use")
        needed = self.peak_blocks(req)
        if needed > self.kv.num_usable_blocks:
            raise RequestError(
                f"request needs {needed} KV blocks ({self.max_tokens_of(req)} tokens of prompt + max_tokens) "
                f"but the pool has only {self.kv.num_usable_blocks}; lower max_tokens or raise --kv-cache-memory",
                "max_tokens",
            )
        if len(group) > self.max_num_seqs:
            raise RequestError(f"n = {len(group)} sequences exceed --max-num-seqs {self.max_num_seqs}", "n")
        if self.max_num_waiting is not None and len(self.waiting) >= self.max_num_waiting:
            n = self.max_num_waiting
            raise QueueFullError(f"the waiting queue is full ({n} request{'' if n == 1 else 's'}); retry later")
        attach_followers(req, followers)
        for r in group:
            self.requests[r.request_id] = r
        self._enqueue(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request (abort, stop string, ...) and free its blocks. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            heir = promote_heir(req)  # a leader still prefilling: the next sibling starts over
            if heir is not None:
                self.waiting.appendleft(heir)
        else:
            drop_follower(req, [*self.waiting, *self.running])  # a follower that never forked
            if req in self.waiting:
                i = self.waiting.index(req)
                del self.waiting[i]
                heir = promote_heir(req)  # the next sibling prefills the prompt instead
                if heir is not None:
                    self.waiting.insert(i, heir)
        req.followers = []
        if req.kv_export is not None and status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            pin_blocks(self.kv, request_id, pin_id_of(request_id))  # a producer's prompt KV outlives it
        req.status = status
        self.kv.free(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

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

    def _fork_followers(self, leader: Request) -> list[Request]:
        """The leader computed the prompt: its waiting siblings share its blocks and run."""
        forked = fork_followers(leader, self.kv)
        self.running.extend(forked)
        return forked

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance ``num_computed_tokens``, append sampled tokens, finish requests that hit
        EOS, a stop token id, max_tokens or max_model_len (their blocks are freed).

        Args:
            out: the step's schedule.
            sampled: request_id → sampled token id, for requests with ``sample=True`` and
                for the followers of a leader whose prompt completes in this step (they fork);
                a request missing from it (a beam, :mod:`.beam`) gets no token here.
        Returns:
            Requests that finished in this step.
        """
        finished = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_new_tokens
            bs = self.kv.block_size
            if req.num_computed_tokens // bs != s.num_computed_tokens // bs:  # a block filled up this step
                self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if not s.sample:
                continue
            for r in [req, *(self._fork_followers(req) if req.followers else ())]:
                token = sampled.get(r.request_id)
                if token is None:  # a beam: the beam search appends its token (beam.py)
                    continue
                r.append_output_token(token)
                status = self._check_stop(r, token)
                if status is not None:
                    self.finish_request(r.request_id, status)
                    finished.append(r)
        return finished

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if (not sp.ignore_eos and token in req.eos_token_ids) or token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.is_terminated:  # its stop token, under ignore_eos
            return RequestStatus.FINISHED_STOPPED
        at_limit = req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len
        if at_limit and req.grammar is not None and req.grammar.only_stop_next():
            return RequestStatus.FINISHED_STOPPED  # complete: the next token could only be its stop token
        if req.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return self._overflow(req)
        return None

    def _overflow(self, req: Request) -> RequestStatus | None:
        """``req`` filled the context: "length", or (``context_overflow`` "shift") a context
        shift (:mod:`.context_shift`) in place, or by recomputing the shorter context."""
        if not context_shift.shifts(req):
            return RequestStatus.FINISHED_LENGTH
        done = context_shift.shift(req, self.kv, self.pending_shifts)
        if done is None:
            return RequestStatus.FINISHED_LENGTH
        self.num_context_shifts += 1
        if done == "recompute":
            self._requeue(req)
        return None
