"""After a step: :class:`~llmd.daemon.core.scheduler.Scheduler`'s update from the sampled tokens.

A mixin: the state it advances (``requests``, ``running``, the KV manager) is the
``Scheduler``'s. :meth:`UpdateMixin.update_from_output` (vLLM v1
``Scheduler.update_from_output``) advances each scheduled request's ``num_computed_tokens``
(tokens) by what the step computed, registers the blocks it filled in the prefix cache, forks
a leader's parallel-sampling followers once its prompt is computed
(:mod:`llmd.daemon.core.parallel`), appends the sampled token ids and finishes the requests
that stop. :meth:`UpdateMixin._check_stop` is vLLM v1's ``check_stop``
(`vllm/v1/core/sched/utils.py`): EOS, a stop token id, a terminated grammar, ``max_tokens``,
``max_model_len``; a request that fills ``max_model_len`` with ``context_overflow`` "shift"
context-shifts instead (:meth:`UpdateMixin._overflow`, :mod:`llmd.daemon.core.context_shift`).
"""

from __future__ import annotations

from llmd.daemon.core import context_shift
from llmd.daemon.core.outputs import SchedulerOutput
from llmd.daemon.core.parallel import fork_followers
from llmd.daemon.core.request import Request, RequestStatus


class UpdateMixin:
    """:class:`~llmd.daemon.core.scheduler.Scheduler`'s update after a step and its stop
    checks; reads and sets that class's attributes."""

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
