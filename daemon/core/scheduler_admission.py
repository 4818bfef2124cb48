"""Admission and release of :class:`~llmd.daemon.core.scheduler.Scheduler`'s requests.

A mixin: the queues (``waiting``, ``running``, ``requests``) and the limits are the
``Scheduler``'s, documented there. What it holds:

* :meth:`AdmissionMixin.add_request` (vLLM v1 ``Scheduler.add_request``) checks a request
  before it is queued: its id is not live, one sequence fits the pool alone at its peak
  (:meth:`AdmissionMixin.peak_blocks`, blocks summed over KV cache groups, from
  :meth:`AdmissionMixin.max_tokens_of`, tokens), ``n`` fits ``max_num_seqs``, the waiting
  queue has room, and a non-zero priority comes with the "priority" policy; parallel-sampling
  followers attach to it (:mod:`llmd.daemon.core.parallel`);
* :meth:`AdmissionMixin._enqueue` keeps the waiting queue in priority order, FCFS among
  equals (the order of vLLM v1's ``PriorityRequestQueue``, `vllm/v1/core/sched/request_queue.py`);
  a preempted request goes in front of its class;
* :meth:`AdmissionMixin.finish_request` (vLLM v1 ``Scheduler.finish_requests``) ends a
  request in any state, promotes a sibling to prefill the prompt when a leader goes, pins a
  finished KV producer's prompt blocks (:mod:`llmd.daemon.kv.transfer`) and frees the blocks.
"""

from __future__ import annotations

from llmd.daemon.core import context_shift
from llmd.daemon.core.errors import QueueFullError, RequestError
from llmd.daemon.core.parallel import attach_followers, drop_follower, promote_heir
from llmd.daemon.core.request import Request, RequestStatus
from llmd.daemon.kv.transfer import pin_blocks, pin_id_of


class AdmissionMixin:
    """:class:`~llmd.daemon.core.scheduler.Scheduler`'s admission checks, waiting-queue order and
    request release; reads and sets that class's attributes."""

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
