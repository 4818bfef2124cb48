"""Requests, their sampling parameters and their lifecycle status.

Vocabulary follows vLLM v1 (`vllm/v1/request.py`): a request owns one list of token ids (its
prompt, then the output tokens generated so far; vLLM's ``_all_token_ids``), the prompt's
length, and ``num_computed_tokens`` (tokens whose K/V are already in the paged KV cache).
"""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmd.daemon.core.errors import RequestError
from llmd.daemon.core.grammar import GrammarSpec, GrammarState


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


#: the smallest temperature above 0 that sampling uses: lower ones are raised to it, as vLLM's
#: ``SamplingParams`` does (its ``_MAX_TEMP``), because dividing float32 logits by them overflows
MIN_TEMPERATURE = 1e-2


@dataclass
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM semantics).

    Attributes:
        max_tokens: new tokens to generate at most; ``None`` means "the remaining context"
            (``max_model_len - prompt_tokens``), resolved by the engine at admission.
        temperature: 0 means greedy (argmax); values in (0, :data:`MIN_TEMPERATURE`) are raised to it.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        top_p: nucleus sampling mass in (0, 1]; 1 disables.
        min_p: drop tokens whose probability is below ``min_p * p_max``; 0 disables.
        repetition_penalty: HF/CTRL-style penalty (> 0) on tokens in prompt + output;
            1 disables. Positive logits are divided by it, negative ones multiplied.
        frequency_penalty: subtracted ``count * frequency_penalty`` for output tokens.
        presence_penalty: subtracted once for every token present in the output.
        use_beam_search: beam search instead of sampling (vLLM's extra parameter): the engine's
            ``n`` sequences are the beams (:mod:`llmd.daemon.core.beam`; greedy, no stream).
        length_penalty: beam search's exponent, score = cumulative logprob / (prompt + output
            tokens, a trailing EOS not counted) ** length_penalty (vLLM's definition).
        early_stopping: beam search's stop rule, ``True``, ``False`` or ``"never"`` (vLLM / HF).
        seed: per-request seed; ``None`` draws a random one at creation, so a request's
            own choices are reproducible regardless of batch composition.
        stop: strings that end generation; the matched string is not returned.
        min_tokens: output tokens before EOS, ``stop_token_ids`` or a ``stop`` string may end the
            request (vLLM's): until then the sampler masks the stop tokens (unless a grammar
            allows nothing else) and no stop string may end in their text; 0 disables.
        stop_token_ids: token ids that end generation (added to the model's EOS ids); kept as a
            frozenset, so the per-token stop check is O(1) however many a client sends.
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        logprobs: number of top logprobs to return per token (0 = only the chosen one),
            ``None`` for none. Logprobs are of the raw model distribution (vLLM's convention).
        structured: a structured-output constraint (:class:`~llmd.daemon.core.grammar.GrammarSpec`:
            JSON schema, JSON object, regex, EBNF grammar, choices) or ``None``; each request
            built with it gets its own matcher (:attr:`Request.grammar`).
        logit_bias: token id → bias (OpenAI's ``logit_bias``, in [-100, 100]) added to that row's
            raw logits before the penalties (vLLM's order), or ``None``; logprobs stay those of
            the raw, unbiased distribution. Ids must lie in the vocabulary (the API checks them;
            the sampler fails a row whose ids do not).
        context_overflow: "stop" or "shift" at ``max_model_len`` (:mod:`llmd.daemon.core.context_shift`);
            ``None`` = the daemon's ``--context-overflow`` (the engine resolves it at admission).
        n_keep: tokens a context shift keeps at the head (llama.cpp's ``n_keep``; -1 = the
            prompt); ``None`` = the daemon's ``--keep``.
        truncate_prompt_tokens: keep only the last ``k`` prompt tokens (vLLM's left truncation,
            an explicit opt-in for prompts longer than the context; -1 = ``max_model_len - 1``).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: GrammarSpec | None = None
    logit_bias: dict[int, float] | None = None
    context_overflow: str | None = None
    n_keep: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = frozenset(self.stop_token_ids)
        if self.seed is None:
            self.seed = secrets.randbits(63)
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # logits / 1e-38 overflow to inf: NaN probabilities
            self.temperature = MIN_TEMPERATURE

    def validate(self) -> None:
        """Check ranges; raises :class:`~llmd.daemon.core.errors.RequestError` (a ``ValueError``)
        naming the offending field in its message and its ``param``."""
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}", "top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}", "repetition_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise RequestError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
                               "frequency_penalty")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise RequestError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise RequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                               "min_tokens")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if self.context_overflow not in (None, "stop", "shift"):
            raise RequestError(f"context_overflow must be 'stop' or 'shift', got {self.context_overflow!r}",
                               "context_overflow")
        for name in ("n_keep", "truncate_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < -1
                                  or (name == "truncate_prompt_tokens" and v == 0)):
                raise RequestError(f"{name} must be -1 or an integer >= {0 if name == 'n_keep' else 1}, got {v!r}",
                                   name)
        if self.context_overflow == "shift" and self.use_beam_search:
            raise RequestError("context_overflow 'shift' does not combine with beam search (use_beam_search)",
                               "context_overflow")
        if self.logit_bias and not all(isinstance(t, int) and -100 <= b <= 100 for t, b in self.logit_bias.items()):
            raise RequestError("logit_bias must map integer token ids to biases in [-100, 100]", "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
