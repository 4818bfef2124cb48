"""``/v1/completions`` with a list of prompts, and ``echo``: one engine request per prompt.

OpenAI's ``prompt`` may be a list of strings or of token-id lists (``CompletionCreateParams``);
the answer has one choice per prompt × ``n``, choice ``index = i·n + j`` for prompt ``i``'s
sequence ``j``, and ``usage`` summed over the prompts (each prompt's tokens counted once, as
vLLM's ``serving_completion.py`` does). A stream interleaves the choices, every chunk carrying its
``index``.

Each prompt is its own engine request (:meth:`EngineLoop.submit`, parent id ``{id}-p{i}``, its
``n`` sequences ``{id}-p{i}-{j}``), so prompts are tokenized, admitted and prefix-cached
independently; one :class:`~llmd.daemon.serving.streaming.OutputBuffer` takes all their outputs,
each re-indexed on the engine thread. :meth:`PromptBatch.abort` aborts every one (a client that
leaves, an engine error in one prompt, a rejected prompt). A single prompt keeps the response
id as its request id (``DELETE /v1/requests/{id}`` aborts it).

``echo: true`` prepends each prompt's text (token ids decoded, special tokens kept) to its
choices' text; streamed, each choice's first chunk carries the prompt. ``echo`` with
``logprobs`` would need the prompt's logprobs, which llmd never computes (the model runner
keeps the logits of sampled positions only), so that pair is refused (400 naming ``echo``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.serving.validation import ApiError, json_value

#: prompts in one /v1/completions request at most (each is its own engine request)
MAX_PROMPTS = 64


def parse_prompts(body: dict, parse_one: Callable[[dict], str | list[int]]) -> list[str | list[int]] | None:
    """The prompts of a batch ``prompt`` (a list of ≥ 2 strings or token-id lists), each
    checked by ``parse_one({"prompt": p})``; None when ``prompt`` is a single prompt.

    Raises:
        ApiError: more than :data:`MAX_PROMPTS` prompts (counted before any is checked), or a
            bad prompt (the message says which, ``prompt[i]``; ``param`` is ``prompt``).
    """
    p = body.get("prompt")
    if not (isinstance(p, list) and len(p) >= 2 and all(isinstance(x, (str, list)) for x in p)):
        return None
    if len(p) > MAX_PROMPTS:
        raise ApiError(f"prompt has {len(p)} prompts, more than the limit of {MAX_PROMPTS} per request", "prompt")
    out = []
    for i, x in enumerate(p):
        try:
            out.append(parse_one({"prompt": x}))
        except ApiError as e:
            raise ApiError(f"prompt[{i}]: {e.message}", "prompt") from None
    return out


def check_echo(body: dict, chat: bool, logprobs: int | None) -> bool:
    """Whether ``echo`` is on (``/v1/completions`` only).

    Raises:
        ApiError: ``echo`` not a boolean, ``echo: true`` on chat, or with ``logprobs``.
    """
    echo = body.get("echo")
    if echo in (None, False):
        return False
    if not isinstance(echo, bool):
        raise ApiError(f"echo must be a boolean, got {json_value(echo)}", "echo")
    if chat:
        raise ApiError("echo is a /v1/completions field; chat replies never repeat the prompt", "echo")
    if logprobs is not None:
        raise ApiError("echo with logprobs is not supported: llmd does not compute the prompt's logprobs "
                       "(send one of them)", "echo")
    return True


async def echo_texts(prompts: list[str | list[int]], engine_loop) -> list[str]:
    """Each prompt's text for ``echo``: strings as sent, token ids decoded by
    :meth:`EngineLoop.detokenize <llmd.daemon.serving.engine_loop.EngineLoop.detokenize>` (special
    tokens kept, on the tokenizer pool, as ``POST /detokenize``: a long prompt takes milliseconds)."""
    texts = list(prompts)
    decoding = {i: engine_loop.detokenize(p) for i, p in enumerate(prompts) if not isinstance(p, str)}
    for i, fut in decoding.items():  # all queued at once, then awaited in turn
        texts[i] = await asyncio.wrap_future(fut)
    return texts


class PromptBatch:
    """The engine requests of one HTTP request's prompts (one, or a batch).

    Args:
        engine_loop: the :class:`~llmd.daemon.serving.engine_loop.EngineLoop`.
        request_id: the response id; a single prompt's request id, a batch's prefix.
        prompts: the prompts (text, token ids or chat messages), submitted at once.
        parsed: the :class:`~llmd.daemon.serving.validation.ParsedRequest` (params, n, salt, priority).
        sink: the one sink of every output (re-indexed to ``i·n + j`` for prompt ``i``).
        kv: the engine loop's prefill/decode keywords (``kv_transfer/handshake.py``; one prompt).
    """

    def __init__(self, engine_loop, request_id: str, prompts: list, parsed, sink: Callable, kv: dict | None = None):
        self.engine_loop, self.n = engine_loop, parsed.n
        self.ids = [request_id] if len(prompts) == 1 else [f"{request_id}-p{i}" for i in range(len(prompts))]
        self._futures = [engine_loop.submit(rid, prompt, parsed.params, parsed.n, self._sink(sink, i),
                                            cache_salt=parsed.cache_salt, priority=parsed.priority, kv=kv)
                         for i, (rid, prompt) in enumerate(zip(self.ids, prompts))]

    def _sink(self, sink: Callable, i: int) -> Callable:
        if i == 0:
            return sink
        shift = i * self.n
        return lambda out: sink(dataclasses.replace(out, index=out.index + shift))  # on the engine thread

    async def wait(self) -> tuple[int, list[int]]:
        """Wait until every prompt is queued: ``(sequences in all, prompt tokens per prompt)``.

        Every submit has resolved before this returns or raises (so an abort queued afterwards
        finds whatever was queued).

        Raises:
            LlmdError: the first prompt the engine refused (its message prefixed ``prompt[i]:``
                in a batch); the other prompts may be queued: call :meth:`abort`.
        """
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in self._futures), return_exceptions=True)
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                if len(results) > 1 and isinstance(r, LlmdError):
                    r.args = (f"prompt[{i}]: {r}", *r.args[1:])
                raise r
        return sum(len(children) for children, _ in results), [n_prompt for _, n_prompt in results]

    def abort(self) -> None:
        """Abort every prompt's sequences (queued on the engine loop; unknown ids are no-ops)."""
        for rid in self.ids:
            self.engine_loop.abort(rid)
