"""A request's sampling parameters: :class:`SamplingParams` (OpenAI / vLLM semantics: temperature,
top-k / top-p / min-p, penalties, beam search, seed, stop strings and tokens, logprobs, a
structured-output constraint, logit bias, context overflow), its defaults and range checks
(:meth:`SamplingParams.validate` raises :class:`~llmd.daemon.core.errors.RequestError` naming the
field), and :data:`MIN_TEMPERATURE`, the clamp of tiny temperatures.

Validated by ``Engine.add_request`` (and by the API's request rendering, before it).
Both names are re-exported by :mod:`llmd.daemon.core.request` (their home before).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from llmd.daemon.core.errors import RequestError
from llmd.daemon.core.grammar import GrammarSpec

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
