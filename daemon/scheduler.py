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
    #: copy-on-write (src, dst) block pairs to copy before the forward (parallel sampling)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

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

    def add_request(self, req: Request, followers: list[Request] | tuple = ()) -> None:
        """Queue a request. Its ``sampling_params.max_tokens`` must already be resolved.

        ``followers`` are parallel-sampling siblings with the same prompt: they wait until
        ``req`` has computed the prompt, then fork its blocks (the prompt is prefilled once)
        and sample their first token from the same logits.

        Raises:
            ValueError: an id is already live, or the request can never fit in the KV pool
                (or in ``max_num_seqs``), even alone.
        """
        group = [req, *followers]
        for r in group:
            if r.request_id in self.requests or sum(x.request_id == r.request_id for x in group) > 1:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        needed = self.peak_blocks(req) * len(group)
        if needed > self.kv.num_usable_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks ({len(group)} x {self.reserved_tokens(req)} tokens of prompt + "
                f"max_tokens) but the pool has only {self.kv.num_usable_blocks}; lower max_tokens or n, or raise --kv-cache-memory"
            )
        if len(group) > self.max_num_seqs:
            raise ValueError(f"n = {len(group)} sequences exceed --max-num-seqs {self.max_num_seqs}")
        req.followers = list(followers)
        for r in group:
            self.requests[r.request_id] = r
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request (abort, stop string, ...) and free its blocks. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            for leader in [*self.waiting, *self.running]:
                if req in leader.followers:  # a follower that never forked
                    leader.followers.remove(req)
            if req in self.waiting:
                i = self.waiting.index(req)
                del self.waiting[i]
                if req.followers:  # promote the next sibling; it prefills the prompt instead
                    heir, heir.followers = req.followers[0], req.followers[1:]
                    self.waiting.insert(i, heir)
        if req.followers and req.status == RequestStatus.RUNNING:
            heir, heir.followers = req.followers[0], req.followers[1:]
            self.waiting.appendleft(heir)
        req.followers = []
        req.status = status
        self.reserved_blocks.pop(request_id, None)
        self.kv.free(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------
    def _schedule_one(self, req: Request, budget: int, computed_blocks=None) -> ScheduledRequest:
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        start = req.num_computed_tokens
        if self.kv.allocate_slots(req.request_id, start + num_new, start, computed_blocks) is None:
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
            n = 1 + len(req.followers)
            peak = self.peak_blocks(req) * n
            if sum(self.reserved_blocks.values()) + peak > self.kv.num_usable_blocks:
                break  # head-of-line: FCFS order is kept
            if len(self.running) + n > self.max_num_seqs:
                break
            # look the prefix up now, when it is admitted (never a stale count)
            num_cached, blocks = self.kv.get_computed_blocks(
                req.request_id, req.all_token_ids, req.num_prompt_tokens, req.cache_salt)
            self.kv.record_prefix_lookup(req.num_prompt_tokens, num_cached)
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            self.reserved_blocks[req.request_id] = peak
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            s = self._schedule_one(req, budget, blocks)
            budget -= s.num_new_tokens
            out.scheduled.append(s)
        out.blocks_to_copy = self.kv.take_pending_copies()
        return out

    def _fork_followers(self, leader: Request) -> list[Request]:
        """The leader computed the prompt: its waiting siblings share its blocks and run."""
        followers, leader.followers = leader.followers, []
        per_seq = self.reserved_blocks[leader.request_id] // (1 + len(followers))
        self.reserved_blocks[leader.request_id] = per_seq
        for f in followers:
            self.kv.fork(leader.request_id, f.request_id)
            f.num_computed_tokens, f.num_cached_tokens = leader.num_computed_tokens, leader.num_cached_tokens
            f.status = RequestStatus.RUNNING
            self.reserved_blocks[f.request_id] = per_seq
            self.running.append(f)
        return followers

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance ``num_computed_tokens``, append sampled tokens, finish requests that hit
        EOS, a stop token id, max_tokens or max_model_len (their blocks are freed).

        Args:
            out: the step's schedule.
            sampled: request_id → sampled token id, for requests with ``sample=True`` and
                for the followers of a leader whose prompt completes in this step (they fork).
        Returns:
            Requests that finished in this step.
        """
        finished = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if not s.sample:
                continue
            for r in [req, *(self._fork_followers(req) if req.followers else ())]:
                token = sampled[r.request_id]
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
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
