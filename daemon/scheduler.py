"""Iteration-level (continuous) batching scheduler.

Every step, finished requests have already left, running requests get their next tokens
first (one per decode, a chunk for an unfinished prefill), and waiting requests join FCFS
while the token budget, ``max_num_seqs`` and the KV pool allow (Orca, Yu et al. OSDI'22;
vLLM v1 ``vllm/v1/core/sched/scheduler.py``). A prompt longer than the remaining budget is
prefilled in chunks over several steps while the others keep decoding.

Blocks are allocated step by step as tokens are computed (sliding-window groups free the
blocks that fell out of their window at the same time). Until preemption exists, admission
counts each running request's peak: the most blocks it can ever hold over all KV cache
groups (``ceil((prompt + max_tokens) / block_size)`` for full attention, the window bound
for sliding windows, :meth:`KVCacheGroupSpec.max_blocks`), and admits a request only while
the peaks fit in the pool, so a running request never runs out of KV space. The scheduler
returns plain data and never touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmd.daemon.kv import KVCacheManager
from llmd.daemon.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request_id: the request.
        token_ids: the tokens to compute this step (``num_new_tokens`` of them).
        num_computed_tokens: tokens already in the KV cache before this step (= first position).
        block_tables: per KV cache group, block ids covering at least
            ``num_computed_tokens + len(token_ids)`` tokens (0 = null block where a sliding
            window dropped a block).
        sample: True when this step reaches the end of the request's known tokens, so a new
            token is sampled from the last position's logits.
        is_prefill: True while the prompt is not fully computed.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_tables: list[list[int]]
    sample: bool
    is_prefill: bool

    @property
    def block_table(self) -> list[int]:
        """The first group's block table (the only one for full-attention-only models)."""
        return self.block_tables[0]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What runs in one step: requests in batch order and the total token count."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefills(self) -> int:
        return sum(s.is_prefill for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(not s.is_prefill for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """Decides which requests run each step and how many tokens each computes.

    Args:
        kv_cache_manager: owner of the block tables.
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens per step at most (the token budget).
        max_model_len: context cap in tokens; generation stops at it (finish_reason "length").
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # request_id -> peak blocks reserved for a running request (see module docstring)
        self.reserved_blocks: dict[str, int] = {}

    # ---- admission ----------------------------------------------------------------
    def reserved_tokens(self, req: Request) -> int:
        """Tokens reserved at admission: prompt + max_tokens (max_tokens resolved by the engine)."""
        return req.num_prompt_tokens + req.sampling_params.max_tokens

    def peak_blocks(self, req: Request) -> int:
        """Most blocks ``req`` can hold at once, summed over KV cache groups."""
        n = self.reserved_tokens(req)
        return sum(g.max_blocks(n, self.kv.block_size, self.max_num_batched_tokens) for g in self.kv.groups)

    def add_request(self, req: Request) -> None:
        """Queue a request. Its ``sampling_params.max_tokens`` must already be resolved.

        Raises:
            ValueError: the id is already live, or the request can never fit in the KV pool, even alone.
        """
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        needed = self.peak_blocks(req)
        if needed > self.kv.num_usable_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks ({self.reserved_tokens(req)} tokens of prompt + max_tokens) "
                f"but the pool has only {self.kv.num_usable_blocks}; lower max_tokens or raise --kv-cache-memory"
            )
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request (abort, stop string, ...) and free its blocks. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        self.reserved_blocks.pop(request_id, None)
        self.kv.free(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------
    def _schedule_one(self, req: Request, budget: int) -> ScheduledRequest:
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        start = req.num_computed_tokens
        if self.kv.allocate_slots(req.request_id, start + num_new, start) is None:
            raise RuntimeError(f"KV pool exhausted for {req.request_id!r} despite its reservation (bug)")
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_tables=self.kv.get_block_tables(req.request_id),
            sample=start + num_new == req.num_tokens,
            is_prefill=start < req.num_prompt_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests: running ones first (decodes and prefill chunks), then
        waiting ones FCFS while budget, ``max_num_seqs`` and KV blocks last."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in self.running:
            if budget <= 0:
                break
            s = self._schedule_one(req, budget)
            budget -= s.num_new_tokens
            out.scheduled.append(s)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            peak = self.peak_blocks(req)
            if sum(self.reserved_blocks.values()) + peak > self.kv.num_usable_blocks:
                break  # head-of-line: FCFS order is kept
            self.reserved_blocks[req.request_id] = peak
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            s = self._schedule_one(req, budget)
            budget -= s.num_new_tokens
            out.scheduled.append(s)
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance ``num_computed_tokens``, append sampled tokens, finish requests that hit
        EOS, a stop token id, max_tokens or max_model_len (their blocks are freed).

        Args:
            out: the step's schedule.
            sampled: request_id → sampled token id, for requests with ``sample=True``.
        Returns:
            Requests that finished in this step.
        """
        finished = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_new_tokens
            if not s.sample:
                continue
            token = sampled[s.request_id]
            req.append_output_token(token)
            status = self._check_stop(req, token)
            if status is not None:
                self.finish_request(req.request_id, status)
                finished.append(req)
        return finished

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if (not sp.ignore_eos and token in req.eos_token_ids) or token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
