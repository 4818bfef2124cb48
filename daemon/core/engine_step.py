"""One engine iteration: :meth:`~StepMixin.step` is schedule → run → postprocess (nano-vllm
``llm_engine.py``, vLLM v1 ``EngineCore.step``): the scheduler picks requests, the runner computes
logits and samples, the scheduler appends tokens and frees finished requests, and the detokenizer
turns new tokens into safe text (stop strings end a request here). Beam-search groups whose beams
all reported advance here too (:mod:`.beam`), each group's end in one output per beam.

One bad request never hurts the others: a row the sampler cannot sample (non-finite logits, its
own sampling raising; ``result.failed`` maps its row to the message) and an exception in one
request's postprocessing (detokenizer, stop strings) end that request alone with
``finish_reason="error"``; a step that raises as a whole raises out of :meth:`~StepMixin.step`
(the caller's :meth:`~llmd.daemon.core.engine.Engine.fail_requests`). Each step returns
:class:`~.outputs.RequestOutput` s: new token ids, new text, per-token logprobs
(:class:`~.outputs.TokenLogprobs` or None).

:class:`StepMixin` is a base of :class:`~llmd.daemon.core.engine.Engine`; it uses the engine's
``scheduler``, ``runner``, ``kv_exchange``, ``beams``, ``detokenizers``, ``thread_governor`` and
``faults``, its request endings (``_fail``, ``_finished``) and its statistics (``_record_step``,
:mod:`.engine_stats`); it sets ``last_scheduler_output`` and ``_unreported`` (this step's requests
whose output is not made yet, for ``fail_requests``).
"""

from __future__ import annotations

import logging

from llmd.daemon.core.beam import final_outputs
from llmd.daemon.core.outputs import RequestOutput, TokenLogprobs
from llmd.daemon.core.parallel import sampling_rows
from llmd.daemon.core.request import Request, RequestStatus

log = logging.getLogger("llmd.engine")  # the engine's logger, as before the split


class StepMixin:
    """The iteration of :class:`~llmd.daemon.core.engine.Engine` (see the module docstring)."""

    # ---- one iteration ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns an output for every request that produced a
        token (or finished, ``finish_reason="error"`` included) in it.

        Raises whatever the forward or the scheduler raises (the step as a whole failed: see
        :meth:`fail_requests`); one request's own failure is its ``error`` output instead."""
        sched = self.scheduler.schedule()
        self.last_scheduler_output = sched
        if not sched:
            return []
        if self.thread_governor is not None:
            self.thread_governor.tick()  # every 0.5 s: a /proc/stat read, maybe torch.set_num_threads
        reqs = {s.request_id: self.scheduler.requests[s.request_id] for s in sched.scheduled}
        self.kv_exchange.apply_scheduled(reqs)  # pulled KV into the blocks admitted with it, before the forward
        sampling, rows = sampling_rows(sched.scheduled, reqs)  # followers fork now: their leader's row
        previous_token_times = [r.last_token_time for r in sampling]
        result = self.runner.execute(sched, sampling, rows)
        sampled, logprobs, outputs = {}, {}, []
        if result is not None:
            for b, (req, tok, lp) in enumerate(zip(sampling, result.sampled_token_ids, result.logprobs)):
                if b in result.failed:  # fails before its token is appended: the scheduler skips it
                    outputs.append(self._fail(req, result.failed[b]))
                else:
                    sampled[req.request_id], logprobs[req.request_id] = tok, lp
        beam_groups = self.beams.take_reports(sampling, sampled, logprobs)  # beams get no token from the scheduler
        if outputs or beam_groups:
            kept = [(r, t) for r, t in zip(sampling, previous_token_times) if r.request_id in sampled]
            sampling, previous_token_times = [r for r, _ in kept], [t for _, t in kept]
        self._unreported = {req.request_id: req for req in sampling}
        self.scheduler.update_from_output(sched, sampled)
        if beam_groups:
            outputs += self._advance_beams(beam_groups)
        if self.faults is not None:
            self.faults.check_step(sampling)
        self._record_step(sched.num_prefill_tokens, sampling, previous_token_times)
        for req in sampling:
            try:
                outputs.append(self._postprocess(req, sampled[req.request_id], logprobs[req.request_id]))
            except Exception as e:  # this request fails alone; the rest of the step goes on
                log.exception("postprocessing %s failed", req.request_id)
                outputs.append(self._fail(req, f"postprocessing failed: {type(e).__name__}: {e}"))
            self._unreported.pop(req.request_id, None)
        return outputs

    def _advance_beams(self, groups: list) -> list[RequestOutput]:
        """Step the beam-search groups whose beams all reported (:mod:`.beam`); the final
        outputs of those that ended: slot ``i`` carries the ``i``-th best beam, all its tokens
        and text in one output."""
        outputs = []
        for g, live in self.beams.advance(groups, self.scheduler):
            for req, hyp in final_outputs(g, live):
                status = RequestStatus.FINISHED_STOPPED if hyp.stopped else RequestStatus.FINISHED_LENGTH
                text = self._beam_answer(req, hyp.output_token_ids, hyp.stopped)
                req.stop_reason = hyp.output_token_ids[-1] if hyp.stopped else None
                self.scheduler.finish_request(req.request_id, status)
                self._finished(req, status.finish_reason)
                outputs.append(RequestOutput(
                    request_id=req.request_id, new_token_ids=list(hyp.output_token_ids), new_text=text,
                    logprobs=[None] * len(hyp.output_token_ids), finished=True, finish_reason=status.finish_reason,
                    num_prompt_tokens=req.total_prompt_tokens, num_output_tokens=req.num_output_tokens,
                    num_cached_tokens=req.num_cached_tokens, index=req.sibling_index))
        return outputs

    def _beam_answer(self, req: Request, tokens: list[int], stopped: bool) -> str:
        """A beam-search slot leaving with a beam's answer (its group ended or was aborted):
        ``tokens`` become its output, its detokenizer goes; returns their whole text (a stop
        token's own text left out, as :meth:`_postprocess` leaves it)."""
        req.token_ids[req.num_prompt_tokens:] = tokens
        detok = self.detokenizers.pop(req.request_id)
        return detok.update(tokens[:-1] if stopped else tokens) + detok.finish()

    def _postprocess(self, req: Request, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        if self.faults is not None:
            self.faults.check_postprocess(req)
        detok = self.detokenizers[req.request_id]
        # a stop token (stop_token_ids, EOS) ends the text without its own, as vLLM's detokenizer
        # leaves it out; its id and logprob stay in the output
        text = "" if req.is_finished and req.stop_reason == token else detok.update([token])
        if detok.stop_matched is not None and not req.is_finished:
            req.stop_reason = detok.stop_matched
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if req.is_finished:
            if detok.stop_matched is None:
                text += detok.finish()
            if detok.stop_matched is not None and req.status == RequestStatus.FINISHED_LENGTH:
                # the last token completed a stop string (or finish() found one): the text is cut
                # there, so "stop", as vLLM reports it
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_matched
            del self.detokenizers[req.request_id]
            self._finished(req, req.status.finish_reason)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_text=text,
            logprobs=[lp],
            finished=req.is_finished,
            finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.total_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            index=req.sibling_index,
            kv_transfer_params=self.kv_exchange.on_finished(req) if req.is_finished else None,
        )
