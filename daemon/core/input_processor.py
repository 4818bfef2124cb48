"""The one path from a prompt (text, token ids or chat messages) to token ids, with its checks.

Everything that turns user input into tokens goes through here: the engine's
``add_request`` (``llmd generate``, ``llmd chat --no-daemon``), the engine loop's tokenizer
worker thread (every daemon request and ``POST /tokenize``: the engine thread then only
receives a :class:`ProcessedPrompt`) and ``llmd bench kv-quality``.

* :func:`check_prompt_size`: text that cannot fit the context is refused *before* it is
  tokenized (the server calls it on the event loop: megabytes of text tokenized on the
  engine thread would stall every stream for seconds);
* :meth:`InputProcessor.tokenize`: text → ``tokenizer.encode`` (BOS per the GGUF), chat
  messages → the model's chat template, token ids → checked against the vocabulary;
* :meth:`InputProcessor.process`: the above plus the length rules: an empty prompt, a prompt
  that leaves no room to generate, or prompt + ``max_tokens`` beyond ``max_model_len`` are
  refused (never clamped); a missing ``max_tokens`` becomes the remaining context.

Every refusal is a :class:`~llmd.daemon.core.errors.RequestError` whose ``param`` names the
field: ``"prompt"`` (``"messages"`` for a message list) or ``"max_tokens"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmd.daemon.core.errors import LlmdError, RequestError
from llmd.daemon.core.request import SamplingParams
from llmd.models.errors import NoChatTemplateError

#: characters per token no real prompt exceeds; text longer than this × the context cannot fit
MAX_CHARS_PER_TOKEN = 64

Prompt = str | list[int] | list[dict]


def model_context(max_model_len: int | None, max_position: int) -> int:
    """The engine's context in tokens: ``--max-model-len`` (None: the model's) capped at the
    model's ``max_position``."""
    return min(max_model_len or max_position, max_position)


def is_chat(prompt) -> bool:
    """Whether ``prompt`` is a list of chat messages (``{"role", "content"}`` dicts)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def prompt_field(prompt) -> str:
    """The request field a prompt came in: ``messages`` for chat messages, else ``prompt``."""
    return "messages" if is_chat(prompt) else "prompt"


def check_prompt_size(prompt, max_model_len: int) -> None:
    """Refuse text (or messages) longer than ``MAX_CHARS_PER_TOKEN`` × the context, untokenized.

    Raises:
        RequestError: naming the characters, the context and the limit.
    """
    if is_chat(prompt):
        n = sum(len(m["content"]) for m in prompt)
    else:
        n = len(prompt) if isinstance(prompt, str) else 0
    limit = MAX_CHARS_PER_TOKEN * max_model_len
    if n > limit:
        raise RequestError(f"prompt has {n} characters, more than any prompt that fits the context of {max_model_len} "
                           f"tokens (limit {limit} characters)", prompt_field(prompt))


def max_keep(max_model_len: int, block_size: int) -> int:
    """The largest ``n_keep`` / ``--keep`` a context shift can honour: its whole blocks plus one
    block to discard must fit below the context's last position."""
    return max(0, (max_model_len - 1 - block_size) // block_size * block_size)


def check_keep_option(keep: int, max_model_len: int, block_size: int) -> None:
    """Refuse a ``--keep`` above :func:`max_keep`: a shift would leave no whole block of the
    context to discard. Checked whatever ``--context-overflow`` says, since a request may ask
    for ``context_overflow: "shift"`` itself (``llmd chat`` always does) and then keeps
    ``--keep`` tokens unless it gives ``n_keep``.

    Raises:
        LlmdError: ``--keep 200 leaves no whole block of the 128-token context to discard: at most 96 ...``.
    """
    if keep > (most := max_keep(max_model_len, block_size)):
        raise LlmdError(f"--keep {keep} leaves no whole block of the {max_model_len}-token "
                        f"context to discard: at most {most} (or -1, the prompt)")


@dataclass
class ProcessedPrompt:
    """A prompt ready for the scheduler.

    Attributes:
        token_ids: the prompt's tokens.
        max_tokens_defaulted: True when ``max_tokens`` was not given and became the remaining
            context (the engine adds a hint to a later capacity error).
    """

    token_ids: list[int]
    max_tokens_defaulted: bool


class InputProcessor:
    """Tokenizes prompts for one engine and applies its context rules.

    Args:
        tokenizer: the model's :class:`~llmd.models.tokenizer.Tokenizer`.
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_model_len: the engine's context (prompt + output tokens).
        context_overflow, keep: the daemon's ``--context-overflow`` and ``--keep``, filled into
            a request's ``SamplingParams`` that leaves them unset.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, context_overflow: str = "stop",
                 keep: int = 0, block_size: int = 16):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.context_overflow, self.keep = context_overflow, keep
        self.max_keep = max_keep(max_model_len, block_size)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of text, chat messages (the model's template) or token ids (checked).

        Raises:
            RequestError: token ids outside the vocabulary; chat messages for a model without a
                chat template (``param`` "messages").
            LlmdError: the chat template refused the messages.
        """
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if is_chat(prompt):
            try:
                return self.tokenizer.apply_chat(prompt)
            except NoChatTemplateError as e:
                raise RequestError(str(e), "messages") from None
        ids = list(prompt)
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt")
        return ids

    def process(self, prompt: Prompt, params: SamplingParams) -> ProcessedPrompt:
        """:meth:`tokenize` and the length rules; resolves ``params.max_tokens`` in place when
        it is None (the remaining context), and ``context_overflow`` / ``n_keep`` from the
        daemon's defaults. ``truncate_prompt_tokens = k`` keeps the last ``k`` prompt tokens
        (-1: the last ``max_model_len - 1``). Under ``context_overflow`` "shift", prompt +
        ``max_tokens`` may exceed the context (the sequence shifts when it fills it).

        Raises:
            RequestError: an empty prompt, one that leaves no room to generate, prompt +
                ``max_tokens`` beyond the context under "stop" (``param`` "max_tokens"),
                ``truncate_prompt_tokens`` not below the context, or under "shift" an ``n_keep``
                that leaves no whole block to discard (-1: a prompt longer than that, when
                prompt + ``max_tokens`` passes the context).
        """
        field = prompt_field(prompt)
        ids = self.tokenize(prompt)
        if not ids:
            raise RequestError("the prompt is empty (0 tokens)", field)
        if params.context_overflow is None:  # beams stop at the context (they cannot shift)
            params.context_overflow = "stop" if params.use_beam_search else self.context_overflow
        if params.n_keep is None:
            params.n_keep = self.keep
        n, context = len(ids), self.max_model_len
        if params.context_overflow == "shift" and params.n_keep > self.max_keep:
            raise RequestError(f"n_keep ({params.n_keep}) leaves no whole block of the {context}-token context to "
                               f"discard: at most {self.max_keep} (or -1, the prompt)", "n_keep")
        k = params.truncate_prompt_tokens
        if k is not None:
            if k >= context:
                raise RequestError(f"truncate_prompt_tokens ({k}) must be below the context of {context} tokens "
                                   "(max-model-len), or -1", "truncate_prompt_tokens")
            ids = ids[-(context - 1 if k == -1 else k):]
            n = len(ids)
        if n >= context:
            raise RequestError(f"prompt has {n} tokens but the context is {context} tokens (max-model-len), "
                               "leaving no room to generate (truncate_prompt_tokens, llmd generate "
                               "--truncate-prompt-tokens, keeps its end)", field)
        defaulted = params.max_tokens is None
        if defaulted:
            params.max_tokens = context - n
        elif n + params.max_tokens > context and params.context_overflow != "shift":
            if params.use_beam_search:  # beams cannot shift: no hint that would only get another 400
                hint = f"beams stop at the context: max_tokens <= {context - n}"
            elif self.context_overflow == "shift":  # the daemon shifts; this request asked for "stop"
                hint = (f"context_overflow \"stop\" ends at the context: max_tokens <= {context - n}, or leave "
                        "context_overflow out to shift as this daemon does")
            else:
                hint = "context_overflow \"shift\" or --context-overflow shift goes on past it"
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                               f"exceeds the context of {context} tokens ({hint})", "max_tokens")
        elif n + params.max_tokens > context and params.n_keep == -1 and n > self.max_keep:
            # the explicit n_keep check above, for -1 once the prompt's length is known: it would never shift
            raise RequestError(f"n_keep -1 keeps the whole prompt ({n} tokens), which leaves no whole block of the "
                               f"{context}-token context to discard (at most {self.max_keep}): give a smaller "
                               f"n_keep, a shorter prompt, or max_tokens <= {context - n}", "n_keep")
        return ProcessedPrompt(ids, defaulted)
