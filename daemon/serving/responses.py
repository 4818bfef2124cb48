"""OpenAI response shapes built from engine :class:`RequestOutput` deltas.

One :class:`ResponseBuilder` per HTTP request; it turns each output of a sequence (choice
``index``) into a streamed chunk, or accumulates it for the final non-streamed body.

Logprobs are those of the raw model distribution (``log_softmax`` of the logits before
penalties, temperature, top-k/top-p; vLLM's convention), in each endpoint's shape:

* ``/v1/completions``: ``{"tokens": [str], "token_logprobs": [float], "top_logprobs":
  [{str: float}], "text_offset": [int]}`` (character offsets of each token's text within the
  concatenated token texts). Each ``top_logprobs`` entry holds the sampled token first, then
  the ``logprobs`` most likely ones, so up to ``logprobs + 1`` keys, and ``logprobs: 0`` gives
  the sampled token alone (OpenAI's legacy completions: "the API will always return the
  logprob of the sampled token"; vLLM's ``_create_completion_logprobs`` does the same);
* ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}]}]}``.

Tool calls (``tool_choice`` required or a named function; ``structured.py``): a chat reply that
completes its grammar answers ``message: {"role": "assistant", "content": null, "tool_calls":
[...]}`` with ``finish_reason: "tool_calls"``; streamed, the text is held back and the last
chunk of the choice carries the whole ``tool_calls`` delta (each call with its ``index``). A
reply cut by ``max_tokens`` keeps ``finish_reason: "length"`` and its text as ``content``.

Several prompts (``multi_prompt.py``): choice ``index = i·n + j`` for prompt ``i``'s sequence
``j``; ``usage`` sums every prompt's tokens (each counted once) and every choice's. ``echo``
prepends prompt ``i``'s text to its choices' text (streamed: a first chunk per choice).
``stream_options.continuous_usage_stats``: every chunk's ``usage`` is its choice's so far
(``prompt_tokens`` of its prompt, ``completion_tokens`` of that choice; vLLM's shape), the
final usage chunk the sum as always.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from llmd.daemon.core.outputs import RequestOutput
from llmd.daemon.serving.structured import ToolCalling, tool_calls


@dataclass
class _Choice:
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    tok_offset: int = 0  # characters of token text so far (completions ``text_offset``)
    lp: dict = field(default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                              "text_offset": []})
    content: list = field(default_factory=list)


class ResponseBuilder:
    """Builds chunks / the final body for one request.

    Args:
        request_id: the response ``id`` (``cmpl-...`` / ``chatcmpl-...``).
        model: served model id.
        chat: chat shapes instead of completion shapes.
        n: number of choices.
        logprobs: top logprobs per token, or None when logprobs were not asked for.
        token_text: token id → its text (for logprobs).
        tool_calling: report chat replies as ``tool_calls`` (see the module docstring), or None.
        prompts: how many prompts (choices ``prompts × n``).
        echo: each prompt's text to prepend to its choices (completions ``echo``), or None.
        continuous_usage: usage in every streamed chunk (needs ``with_usage`` in the calls).
        token_bytes: token id → its raw bytes (chat logprobs' ``bytes``), or None for the UTF-8
            of ``token_text`` (wrong for a token holding part of a character: it decodes to U+FFFD).
    Attributes:
        prompt_tokens, cached_tokens: per prompt, tokens and prefix-cache hits (from the outputs).
    """

    def __init__(self, request_id: str, model: str, chat: bool, n: int, logprobs: int | None,
                 token_text: Callable[[int], str], tool_calling: ToolCalling | None = None, prompts: int = 1,
                 echo: list[str] | None = None, continuous_usage: bool = False,
                 token_bytes: Callable[[int], list[int]] | None = None):
        self.id, self.model, self.chat, self.logprobs = request_id, model, chat, logprobs
        self.token_bytes = token_bytes or (lambda i: list(token_text(i).encode()))
        self.tool_calling = tool_calling if chat else None
        self.created = int(time.time())
        self.token_text = token_text
        self.n, self.echo, self.continuous_usage = n, echo, continuous_usage
        self.choices = [_Choice() for _ in range(n * prompts)]
        self.prompt_tokens = [0] * prompts
        self.cached_tokens = [0] * prompts

    # ---- pieces ---------------------------------------------------------------------
    def usage(self) -> dict:
        """OpenAI usage: each prompt counted once, completion summed over choices."""
        completion, prompt = sum(c.num_tokens for c in self.choices), sum(self.prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    def choice_usage(self, index: int) -> dict:
        """Choice ``index``'s usage so far (``continuous_usage_stats``)."""
        prompt, completion = self.prompt_tokens[index // self.n], self.choices[index].num_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _logprobs(self, choice: _Choice, out: RequestOutput) -> dict | None:
        """Logprobs of ``out``'s tokens (and record them in ``choice``); None if not asked."""
        if self.logprobs is None:
            return None
        entries = [lp for lp in out.logprobs if lp is not None]
        if self.chat:
            content = []
            for lp in entries:
                tok = self.token_text(lp.token_id)
                top = [{"token": self.token_text(i), "logprob": v, "bytes": self.token_bytes(i)} for i, v in lp.top]
                content.append({"token": tok, "logprob": lp.logprob, "bytes": self.token_bytes(lp.token_id),
                                "top_logprobs": top})
            choice.content += content
            return {"content": content}
        d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = choice.tok_offset
        for lp in entries:
            tok = self.token_text(lp.token_id)
            d["tokens"].append(tok)
            d["token_logprobs"].append(lp.logprob)
            d["top_logprobs"].append({tok: lp.logprob} | {self.token_text(i): v for i, v in lp.top})
            d["text_offset"].append(offset)
            offset += len(tok)
        choice.tok_offset = offset
        for k in d:
            choice.lp[k] += d[k]
        return d

    def _absorb(self, index: int, out: RequestOutput) -> tuple[_Choice, dict | None]:
        choice = self.choices[index]
        lp = self._logprobs(choice, out)
        choice.text += out.new_text
        choice.num_tokens = max(choice.num_tokens, out.num_output_tokens)
        p = index // self.n
        self.prompt_tokens[p] = out.num_prompt_tokens or self.prompt_tokens[p]
        self.cached_tokens[p] = max(self.cached_tokens[p], out.num_cached_tokens)
        if out.finished:
            choice.finish_reason = out.finish_reason
        return choice, lp

    # ---- streaming ------------------------------------------------------------------
    def _chunk(self, choices: list[dict], with_usage: bool, index: int | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            chunk["usage"] = self.choice_usage(index) if self.continuous_usage and index is not None else None
        return chunk

    def role_chunks(self, with_usage: bool) -> list[dict]:
        """Chat streams open each choice with ``delta: {"role": "assistant", "content": ""}``;
        completions with ``echo`` open each with its prompt's text."""
        if not self.chat:
            return [self._chunk([{"index": i, "text": self.echo[i // self.n], "logprobs": None,
                                  "finish_reason": None}], with_usage, i)
                    for i in range(len(self.choices))] if self.echo else []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], with_usage, i) for i in range(len(self.choices))]

    def delta_chunk(self, index: int, out: RequestOutput, with_usage: bool) -> dict | None:
        """The chunk for one output, or None when it carries nothing (text held back, no logprobs)."""
        choice, lp = self._absorb(index, out)
        if self.tool_calling is not None:
            return self._tool_delta(index, choice, out, lp, with_usage)
        delta = out.new_text
        if not delta and lp is None and not out.finished:
            return None
        body = {"index": index, "logprobs": lp, "finish_reason": out.finish_reason if out.finished else None}
        if self.chat:
            body["delta"] = {"content": delta} if delta or not out.finished else {}
        else:
            body["text"] = delta
        return self._chunk([body], with_usage, index)

    def _tool_delta(self, index: int, choice: _Choice, out: RequestOutput, lp, with_usage: bool) -> dict | None:
        if not out.finished:
            return None if lp is None else self._chunk([{"index": index, "delta": {}, "logprobs": lp,
                                                         "finish_reason": None}], with_usage, index)
        message, reason = self._message(choice)
        calls = message.get("tool_calls")
        delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]} if calls else \
            {"content": message["content"]}
        return self._chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}], with_usage,
                           index)

    def _message(self, choice: _Choice) -> tuple[dict, str | None]:
        """A chat choice's ``message`` and ``finish_reason`` (tool calls when they parse)."""
        calls = None
        if self.tool_calling is not None and choice.finish_reason == "stop":
            calls = tool_calls(choice.text, self.tool_calling)
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": choice.text}, choice.finish_reason

    def usage_chunk(self) -> dict:
        """The final chunk of ``stream_options.include_usage``: empty choices plus usage."""
        chunk = self._chunk([], False)
        chunk["usage"] = self.usage()
        return chunk

    # ---- non-streaming --------------------------------------------------------------
    def absorb(self, index: int, out: RequestOutput) -> None:
        self._absorb(index, out)

    def final_body(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            if self.chat:
                lp = {"content": c.content} if self.logprobs is not None else None
                message, reason = self._message(c)
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                lp = None
                if self.logprobs is not None:
                    lp = dict(c.lp)
                text = self.echo[i // self.n] + c.text if self.echo else c.text
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}
