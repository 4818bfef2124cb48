"""Requests, their sampling parameters and their lifecycle status (the sampling parameters live in
:mod:`llmd.daemon.core.sampling_params`, re-exported here).

Vocabulary follows vLLM v1 (`vllm/v1/request.py`): a request owns one list of token ids (its
prompt, then the output tokens generated so far; vLLM's ``_all_token_ids``), the prompt's
length, and ``num_computed_tokens`` (tokens whose K/V are already in the paged KV cache).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from llmd.daemon.core.grammar import GrammarState
from llmd.daemon.core.sampling_params import MIN_TEMPERATURE, SamplingParams  # noqa: F401 (re-exported: their home before)


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every value >= FINISHED_STOPPED is terminal."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5  # this request's own failure (vLLM's FinishReason.ERROR): postprocessing, bad logits

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason`` ("stop", "length", "abort", "error") or None while live."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Request:
    """One sequence being generated: its tokens are **one list**, the prompt then the output.

    Args (and attributes of the same name):
        request_id: unique id (str).
        prompt_token_ids: the prompt (tokens); kept as the head of :attr:`token_ids`.
        sampling_params: see :class:`SamplingParams`.
        eos_token_ids: the model's end-of-sequence / end-of-turn token ids.
        output_token_ids: tokens generated already (tests; normally empty).
        cache_salt: optional prefix-cache salt (requests with different salts never share KV).
        sibling_index: index among the ``n`` sequences of a parallel-sampling request (its
            draws use generators derived from (seed, sibling_index, output position)).
        priority: scheduling priority, lower runs first (FCFS among equals); also the
            preemption order (largest value, then latest arrival, is preempted first).
        arrival_time: ``time.monotonic()`` at creation (seconds) unless given.
        grammar: this sequence's own :class:`~llmd.daemon.core.grammar.GrammarState` (structured
            outputs; the sampler masks its logits row with it), advanced by every appended token.

    Attributes:
        token_ids: prompt + generated tokens, one list (``all_token_ids`` is this list: no copy).
        num_prompt_tokens: how many of them are the prompt.
        num_computed_tokens: tokens whose K/V are in the KV cache.
        status: :class:`RequestStatus`.
        first_token_time: monotonic time of the first generated token, for TTFT.
        last_token_time: monotonic time of the latest generated token, for inter-token latency.
        stop_reason: the stop token or stop string that ended the request.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        followers: siblings waiting to fork from this request once its prompt is computed.
        num_preemptions: times this request was preempted (its blocks freed).
        kv_export: ``(transfer_id, pin_seconds)`` of a prefill/decode producer request: its
            prompt's blocks stay pinned when it finishes (:mod:`llmd.daemon.core.kv_exchange`).
        kv_import: a consumer request's pulled :class:`~llmd.daemon.core.kv_transfer.KVPayload`,
            written into its blocks when it is admitted (then None).
        num_shifted_prompt_tokens, num_shifted_output_tokens: tokens a context shift discarded
            (:meth:`discard`); :attr:`token_ids` holds only the context that is left, and
            :attr:`num_prompt_tokens` the prompt tokens still in it.
        num_context_shifts: context shifts so far.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), output_token_ids: Sequence[int] = (), *,
                 cache_salt: str | None = None, sibling_index: int = 0, priority: int = 0,
                 arrival_time: float | None = None, grammar: GrammarState | None = None):
        self.request_id = request_id
        self.token_ids: list[int] = [*prompt_token_ids, *output_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.stop_reason: int | str | None = None
        self.cache_salt = cache_salt
        self.num_cached_tokens = 0
        self.sibling_index = sibling_index
        self.followers: list[Request] = []
        self.priority = priority
        self.num_preemptions = 0
        self.num_shifted_prompt_tokens = self.num_shifted_output_tokens = self.num_context_shifts = 0
        self.grammar = grammar
        self.kv_export: tuple[str, float] | None = None
        self.kv_import = None
        if grammar is not None:  # tokens generated already (tests) put the matcher where they end
            for t in output_token_ids:
                grammar.accept(t)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.num_prompt_tokens} prompt + {self.num_output_tokens} output "
                f"tokens, {self.num_computed_tokens} computed, {self.status.name})")

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (a copy: the head of :attr:`token_ids`)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens still in the context (a copy: the tail of :attr:`token_ids`;
        all of them unless a context shift discarded some)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, those a context shift discarded included."""
        return len(self.token_ids) - self.num_prompt_tokens + self.num_shifted_output_tokens

    @property
    def total_prompt_tokens(self) -> int:
        """The prompt's length as it arrived (usage's ``prompt_tokens``)."""
        return self.num_prompt_tokens + self.num_shifted_prompt_tokens

    def discard(self, start: int, end: int) -> None:
        """Drop context tokens ``[start, end)`` (a context shift; the caller moves the KV).
        ``num_computed_tokens`` falls by ``end - start``; needs ``end <= num_computed_tokens``."""
        assert 0 <= start <= end <= self.num_computed_tokens, (start, end, self.num_computed_tokens)
        from_prompt = max(0, min(end, self.num_prompt_tokens) - start)
        del self.token_ids[start:end]
        self.num_prompt_tokens -= from_prompt
        self.num_shifted_prompt_tokens += from_prompt
        self.num_shifted_output_tokens += end - start - from_prompt
        self.num_computed_tokens -= end - start
        self.num_context_shifts += 1

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + generated tokens: :attr:`token_ids` itself (do not mutate)."""
        return self.token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` (a decode step reads one output token)."""
        return self.token_ids[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.last_token_time = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time
        self.token_ids.append(token_id)
        if self.grammar is not None:  # the sampler only picks tokens the grammar allows
            self.grammar.accept(token_id)
