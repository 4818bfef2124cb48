"""Beam search (vLLM's ``use_beam_search``): ``beam_width`` beams on copy-on-write blocks.

The beams of one request are the ``n`` sequences of :mod:`llmd.daemon.core.parallel` (fixed
*slots*, ids ``{parent}-{i}``): the prompt is prefilled once by slot 0, the others fork its
block tables. Each step every live beam's logits row yields its ``C`` best raw logprobs
(``log_softmax`` of the logits, float32, as HF), ``C = max(2, 1 + #EOS ids) * beam_width``
(HF's ``beams_to_keep``: enough non-EOS candidates even if every top one is an EOS). Then
(:meth:`BeamGroup.step`, HF transformers' ``_beam_search`` rules):

* candidates (beam, token) are ranked by cumulative logprob (on the first step only beam 0's,
  all beams being the prompt); the best ``C`` are kept;
* a candidate that ends (an EOS / stop token id, or ``max_tokens`` / ``max_model_len``
  reached) becomes a finished *hypothesis* only if it ranks among the first ``beam_width``;
  hypotheses are scored with vLLM's length penalty (:func:`beam_score`) and the best
  ``beam_width`` kept;
* the best ``beam_width`` candidates that do not end continue: a beam with one child keeps
  its slot (and blocks); further children take the slots of dropped beams, whose blocks are
  freed at once, and fork the parent's tables (:meth:`KVCacheManager.fork`: ref counts; the
  partly filled last block is copied on the next write, one copy per appending beam);
* the search ends when the length limit is reached, or ``beam_width`` hypotheses exist and
  ``early_stopping`` is ``True``, or (``False`` / ``"never"``) the best live beam's score
  cannot beat the worst hypothesis: ``best_cum / L ** length_penalty <= worst score`` with
  ``L`` = its current length (prompt + output), for ``"never"`` with a positive penalty the
  longest reachable length ``min(prompt + max_tokens, max_model_len)`` (vLLM's rule).
  The result is the hypotheses, best first (at ``length_penalty = 0`` exactly HF's beams).

A group steps only when every live beam has computed its whole sequence and reported this
step's candidates (:meth:`BeamGroup.ready`); a beam whose sibling was preempted waits with
nothing to compute (the scheduler skips it) and the preempted one recomputes and reports
again, so a preempted group resumes exactly. Sources: vLLM v0's ``beam_search`` sampler and
``SequenceGroup`` output processing (``get_beam_search_score``,
``_check_beam_search_early_stopping``); HF ``GenerationMixin._beam_search``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from llmd.daemon.core.errors import RequestError
from llmd.daemon.core.outputs import TokenLogprobs
from llmd.daemon.core.request import Request, RequestStatus, SamplingParams


def beam_score(cum_logprob: float, seq_len: int, ends_with_eos: bool, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: ``cum_logprob / seq_len ** length_penalty`` with
    ``seq_len`` = prompt + output tokens, minus one when the last is an EOS (not counted)."""
    return cum_logprob / ((seq_len - 1 if ends_with_eos else seq_len) ** length_penalty)


def num_candidates(beam_width: int, num_stop_ids: int) -> int:
    """Candidates kept per step (and logprobs asked of each row): HF's ``beams_to_keep``."""
    return max(2, 1 + num_stop_ids) * beam_width


def check_beam_params(params: SamplingParams, n: int) -> None:
    """Refuse what beam search does not combine with; raises :class:`RequestError` naming
    the field (HTTP 400): temperature > 0, penalties, min_tokens, logprobs, stop strings, structured
    outputs (named by their own field), logit_bias, an ``early_stopping`` other than true /
    false / "never", beam width < 2."""
    if n < 2:
        raise RequestError(f"use_beam_search needs n >= 2 beams, got {n}", "n")
    if params.temperature != 0.0:
        raise RequestError(f"use_beam_search is greedy: temperature must be 0, got {params.temperature}",
                           "temperature")
    for name, off in (("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                      ("presence_penalty", 0.0), ("min_tokens", 0)):
        if getattr(params, name) != off:
            raise RequestError(f"{name} is not supported with use_beam_search", name)
    if params.top_k not in (0, -1):
        raise RequestError("top_k is not supported with use_beam_search", "top_k")
    if params.logprobs is not None:
        raise RequestError("logprobs is not supported with use_beam_search", "logprobs")
    if params.stop:
        raise RequestError("stop strings are not supported with use_beam_search (stop_token_ids are)", "stop")
    if params.structured is not None:
        field = params.structured.param or "response_format"
        raise RequestError(f"structured outputs ({field}) are not supported with use_beam_search", field)
    if getattr(params, "logit_bias", None):
        raise RequestError("logit_bias is not supported with use_beam_search", "logit_bias")
    if not (isinstance(params.early_stopping, bool) or params.early_stopping == "never"):
        raise RequestError(f"early_stopping must be true, false or \"never\", got {params.early_stopping!r}",
                           "early_stopping")
    if not isinstance(params.length_penalty, (int, float)) or isinstance(params.length_penalty, bool):
        raise RequestError("length_penalty must be a number", "length_penalty")


@dataclass
class Hypothesis:
    """A finished beam: its output tokens, cumulative logprob, length-penalized score and
    whether it ended with a stop token (else it reached the length limit)."""

    output_token_ids: list[int]
    cum_logprob: float
    score: float
    stopped: bool


@dataclass
class BeamGroup:
    """One beam-search request: its slots (index order), the live beams' cumulative
    logprobs, this step's reports and the hypotheses so far (best first)."""

    slots: list[Request]
    stop_ids: frozenset[int]
    width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    max_model_len: int
    cum: dict[str, float] = field(default_factory=dict)
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    hyps: list[Hypothesis] = field(default_factory=list)
    started: bool = False

    def live(self, requests: dict[str, Request]) -> list[Request]:
        """Slots still live (a failed or aborted one has left the scheduler)."""
        return [r for r in self.slots if requests.get(r.request_id) is r]

    def ready(self, requests: dict[str, Request]) -> bool:
        """Every live beam runs, has computed its whole sequence and reported this step."""
        live = self.live(requests)
        return bool(live) and all(r.status == RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens
                                  and r.request_id in self.reports for r in live)

    def _add_hyp(self, tokens: list[int], cum: float, stopped: bool, seq_len: int) -> None:
        self.hyps.append(Hypothesis(tokens, cum, beam_score(cum, seq_len, stopped, self.length_penalty), stopped))
        self.hyps.sort(key=lambda h: -h.score)  # stable: earlier hypotheses first among equals
        del self.hyps[self.width:]

    def step(self, live: Sequence[Request]) -> list[tuple[Request, int, float]] | None:
        """One selection over the live beams' reports: the beams that continue, as (parent
        slot, token, cumulative logprob) best first, or None when the search has ended (the
        answer is then :attr:`hyps`). Clears the reports."""
        rows = list(live[:1] if not self.started else live)
        c = num_candidates(self.width, len(self.stop_ids))
        cands = sorted(((self.cum.get(r.request_id, 0.0) + lp, i, tok)
                        for i, r in enumerate(rows) for tok, lp in self.reports[r.request_id]), key=lambda x: -x[0])
        self.reports.clear()
        self.started = True
        prompt, out = rows[0].num_prompt_tokens, rows[0].num_output_tokens + 1
        at_limit = out >= self.max_tokens or prompt + out >= self.max_model_len
        running: list[tuple[Request, int, float]] = []
        for rank, (cum, i, tok) in enumerate(cands[:c]):
            stopped = tok in self.stop_ids
            if at_limit or stopped:
                if rank < self.width:
                    self._add_hyp([*rows[i].output_token_ids, tok], cum, stopped, prompt + out)
            elif len(running) < min(self.width, len(live)):
                running.append((rows[i], tok, cum))
        if at_limit or not running:
            return None
        if len(self.hyps) >= self.width:
            if self.early_stopping is True:
                return None
            reach = prompt + out
            if self.early_stopping == "never" and self.length_penalty > 0:
                reach = min(prompt + self.max_tokens, self.max_model_len)
            if beam_score(running[0][2], reach, False, self.length_penalty) <= self.hyps[-1].score:
                return None
        return running


class BeamSearch:
    """The engine's beam-search requests: slot id → its :class:`BeamGroup`.

    Attributes:
        share_blocks: forks share blocks (default); False copies every block instead (the
            benchmark's baseline without sharing).
    """

    def __init__(self) -> None:
        self._group_of: dict[str, BeamGroup] = {}
        self.share_blocks = True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._group_of

    def add(self, slots: list[Request], max_model_len: int) -> None:
        """Register the slots of one beam-search request (already checked with
        :func:`check_beam_params`; ``max_tokens`` resolved): their rows report their ``C``
        best raw logprobs (greedy sampler, ``logprobs = C``)."""
        sp = slots[0].sampling_params
        stop_ids = frozenset(slots[0].eos_token_ids) | sp.stop_token_ids
        g = BeamGroup(slots, stop_ids, len(slots), float(sp.length_penalty), sp.early_stopping, sp.max_tokens,
                      max_model_len)
        for r in slots:
            r.sampling_params = replace(sp, temperature=0.0, logprobs=num_candidates(g.width, len(stop_ids)))
            self._group_of[r.request_id] = g

    def finished(self, request_id: str) -> None:
        self._group_of.pop(request_id, None)

    def members(self, request_id: str) -> list[str]:
        """What an abort of one beam's sequence id ends: every slot of its group, in index
        order (slots are reassigned every step, so one slot alone means nothing to the
        caller). Raises KeyError for an id not of a live search (check ``in`` first)."""
        return [r.request_id for r in self._group_of[request_id].slots]

    def partial_answer(self, request_id: str, requests: dict[str, Request]) -> dict[str, tuple[list[int], bool]]:
        """An aborted search's answer so far, for every live slot of ``request_id``'s group:
        its hypotheses and its live beams (each scored at its current length, as an unfinished
        beam is), best first, slot ``i`` the ``i``-th best (``(output tokens, ended with a stop
        token)``; ``([], False)`` for slots past the candidates, e.g. before the first step)."""
        g = self._group_of[request_id]
        live = g.live(requests)
        cands = [(h.score, h.output_token_ids, h.stopped) for h in g.hyps]
        cands += [(beam_score(g.cum[r.request_id], r.num_tokens, False, g.length_penalty), r.output_token_ids, False)
                  for r in live if r.request_id in g.cum]
        cands.sort(key=lambda c: -c[0])  # stable: hypotheses first among equals
        answer = {r.request_id: (list(toks), stopped) for r, (_, toks, stopped) in zip(live, cands)}
        return {r.request_id: answer.get(r.request_id, ([], False)) for r in live}

    def take_reports(self, sampling: Sequence[Request], sampled: dict[str, int],
                     logprobs: dict[str, TokenLogprobs | None]) -> list[BeamGroup]:
        """Move the beams' rows out of ``sampled`` (the scheduler appends no token for them)
        into their groups' reports; returns the groups that got one, in first-seen order."""
        groups: list[BeamGroup] = []
        for r in sampling:
            g = self._group_of.get(r.request_id)
            if g is None or r.request_id not in sampled:
                continue
            del sampled[r.request_id]
            g.reports[r.request_id] = logprobs[r.request_id].top
            if g not in groups:
                groups.append(g)
        return groups

    def advance(self, groups: list[BeamGroup], scheduler) -> list[tuple[BeamGroup, list[Request]]]:
        """Step every ready group: continuing beams get their token (forks as the module
        docstring says); returns the groups that ended, with their live slots."""
        ended = []
        for g in groups:
            if not g.ready(scheduler.requests):
                continue
            live = g.live(scheduler.requests)
            beams = g.step(live)
            if beams is None:
                ended.append((g, live))
            else:
                self._reassign(g, live, beams, scheduler.kv)
        return ended

    def _reassign(self, g: BeamGroup, live: list[Request], beams: list[tuple[Request, int, float]], kv) -> None:
        """Put the continuing beams into the live slots: a parent's first child stays in its
        slot, further children fork it into the slots of dropped beams (freed first)."""
        placed, extra, parents = [], [], set()
        for parent, tok, cum in beams:
            if id(parent) in parents:
                extra.append((parent, tok, cum))
            else:
                parents.add(id(parent))
                placed.append((parent, tok, cum))
        free = [s for s in live if id(s) not in parents]  # dropped beams: exactly one per extra child
        for slot, (parent, tok, cum) in zip(free, extra):
            kv.free(slot.request_id)
            kv.fork(parent.request_id, slot.request_id, share=self.share_blocks)
            slot.token_ids = list(parent.token_ids)
            slot.num_computed_tokens = parent.num_computed_tokens
            placed.append((slot, tok, cum))
        g.cum = {}
        for slot, tok, cum in placed:
            slot.append_output_token(tok)
            g.cum[slot.request_id] = cum


def check_fits(scheduler, req: Request, width: int) -> None:
    """Refuse a group whose beams could not all coexist without sharing (``width`` times one
    sequence's peak blocks above the pool): with it, a group whose beams wait for a
    preempted sibling can always take it back. Raises :class:`RequestError` (``n``)."""
    need = width * scheduler.peak_blocks(req)
    if need > scheduler.kv.num_usable_blocks:
        raise RequestError(f"{width} beams need up to {need} KV blocks but the pool has only "
                           f"{scheduler.kv.num_usable_blocks}; lower n or max_tokens, or raise --kv-cache-memory", "n")


def final_outputs(g: BeamGroup, live: list[Request]) -> list[tuple[Request, Hypothesis]]:
    """The ended group's answer: the best hypotheses, best first, one per live slot in
    index order (slot ``i`` reports the ``i``-th best beam)."""
    return list(zip(live, g.hyps))
