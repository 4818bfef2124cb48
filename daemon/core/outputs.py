"""Plain data passed between the engine's stages (a leaf module: no imports from llmd).

vLLM v1's ``vllm/v1/core/sched/output.py`` in small: the runner and the input batch import
these, never the scheduler; the serving layer imports :class:`RequestOutput`, never the engine.

* :class:`ScheduledRequest` / :class:`SchedulerOutput` / :class:`BlockShift` /
  :class:`ResidualShift`: what one step runs (scheduler → runner);
* :class:`TokenLogprobs`: one sampled token's logprobs (sampler → outputs);
* :class:`RequestOutput`: what one step produced for one request (engine → callers).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        residual_slots: int4 KV caches: the request's residual slot per group (the 16-bit K of
            its open block); None otherwise.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_tables: list[list[int]]
    sample: bool
    is_prefill: bool
    residual_slots: list[int] | None = None

    @property
    def block_table(self) -> list[int]:
        """The first group's block table (the only one for full-attention-only models)."""
        return self.block_tables[0]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class BlockShift:
    """One block of a context shift (:mod:`llmd.daemon.kv.shift`): re-rotate the keys of block
    ``src`` of KV cache group ``group`` by ``-delta`` positions into block ``dst`` (``dst == src``:
    in place; else V and scales are copied too)."""

    src: int
    dst: int
    group: int
    delta: int


@dataclass(frozen=True)
class ResidualShift:
    """int4 context shift: re-rotate the 16-bit open-block K of residual slot ``slot`` (the
    shifting sequence's slot in KV cache group ``group``) by ``-delta`` positions, in place."""

    slot: int
    group: int
    delta: int


@dataclass
class SchedulerOutput:
    """What runs in one step: requests in batch order and the total token count."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    #: copy-on-write (src, dst) block pairs to copy before the forward (parallel sampling)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    #: context-shift re-rotations, applied before the copies and the forward
    blocks_to_shift: list[BlockShift] = field(default_factory=list)
    #: int4: the shifting sequences' residual slots, re-rotated with the blocks
    residuals_to_shift: list[ResidualShift] = field(default_factory=list)
    #: int4 residual (src slot, dst slot) copies of forks, with the block copies
    residual_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefills(self) -> int:
        return sum(s.is_prefill for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(not s.is_prefill for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens computed this step (prefix-cache hits are not computed; a resumed
        request's recomputation is)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class TokenLogprobs:
    """Logprobs for one sampled token, from the raw (unprocessed) model distribution.

    Attributes:
        token_id: the sampled token.
        logprob: natural-log probability of ``token_id`` under ``log_softmax(raw logits)``.
        top: the ``sampling_params.logprobs`` most likely ``(token_id, logprob)`` pairs,
            sorted by logprob descending (empty when ``logprobs == 0``).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one step produced for one request (a streaming delta).

    Attributes:
        request_id: the request (for ``n > 1``, one sequence's id).
        new_token_ids: tokens generated this step.
        new_text: text released this step (UTF-8 safe, stop strings withheld).
        logprobs: per new token, :class:`TokenLogprobs` or None.
        finished: True on the request's last output.
        finish_reason: "stop", "length", "abort", "error" (this request failed; ``error`` says
            why) or None.
        num_prompt_tokens, num_output_tokens: token counts so far.
        num_cached_tokens: prompt tokens served from the prefix cache.
        index: the sequence's index among the ``n`` of its parallel-sampling request (0 for a
            lone request): the OpenAI choice ``index``.
        error: with ``finish_reason="error"``, one line saying what failed (for the log and
            the client's error body); None otherwise.
        kv_transfer_params: on a prefill/decode producer's last output, its pinned blocks
            (``remote_block_ids``, ``remote_request_id``, ``expires_in_s``; vLLM's field name).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    index: int = 0
    error: str | None = None
    kv_transfer_params: dict | None = None
