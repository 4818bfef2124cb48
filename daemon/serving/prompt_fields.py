"""The prompt of a request body: ``prompt`` (text or token ids) or chat ``messages``.

``prompt`` is a non-empty string, a non-empty list of token ids in ``[0, vocab_size)``, or
OpenAI's batch form holding one of those (a list of several prompts is ``multi_prompt.py``'s).
A token-id prompt is counted against the context before any id is checked: ``max_model_len``
tokens or more leave no room to generate and are refused (with ``truncate_prompt_tokens``, up to
``MAX_CHARS_PER_TOKEN`` × ``max_model_len``, whose end is kept).

``messages`` is a non-empty list of at most ``MAX_MESSAGES`` (OpenAI's 2048) ``{role, content}``
objects, counted before any is read; ``role`` is one of :data:`ROLES` (``developer`` is passed
on as ``system``), ``content`` a non-empty string or a list of text parts (no images), joined;
an assistant message with ``tool_calls`` and no content is rendered as its calls
(``structured.tool_calls_text``). The fields OpenAI types as strings and the templates do not
render (:data:`STRING_FIELDS`: ``name``, ``tool_call_id``, ``refusal``) are strings or null
where present (on any role). Every text must be valid UTF-8. A rejection is an
:class:`ApiError` naming the field (``messages[3].content``, ``messages[1].name``) and what it
allows.

``POST /detokenize``'s ``tokens`` (:func:`parse_tokens`) are token ids checked as a prompt's.
"""

from __future__ import annotations

from llmd.daemon.core.input_processor import MAX_CHARS_PER_TOKEN
from llmd.daemon.serving.json_fields import ApiError, check_utf8, json_typed, json_value, typed_value

MAX_MESSAGES = 2048  # chat messages per request (OpenAI's limit)
ROLES = ("system", "user", "assistant", "developer", "tool")
#: message fields OpenAI types as strings that llmd reads no further (checked on any role, null allowed)
STRING_FIELDS = ("name", "tool_call_id", "refusal")


def _token_ids(v, name: str, vocab_size: int) -> list[int]:
    wrong = [t for t in v if not isinstance(t, int) or isinstance(t, bool)]
    if wrong:
        raise ApiError(f"{name} must be a list of integer token ids, got {typed_value(wrong[0])} in it", name)
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab_size})", name)
    return list(v)


def _prompt(body: dict, vocab_size: int, max_model_len: int | None = None) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # OpenAI's batch form with one prompt
    if isinstance(p, str):
        if not p:
            raise ApiError("prompt is empty; send at least one token of text", "prompt")
        return check_utf8(p, "prompt")
    if isinstance(p, list):
        if not p:
            raise ApiError("prompt is an empty token list; send at least one token id", "prompt")
        if all(isinstance(x, (str, list)) for x in p):
            raise ApiError(f"prompt batches are not supported (got {len(p)} prompts); send one prompt per request",
                           "prompt")
        if isinstance(p[0], (str, list)):  # a list of prompts with something else in it (a token-id list: below)
            odd = next(x for x in p if not isinstance(x, (str, list)))
            raise ApiError(f"prompt mixes prompts (strings or token lists) with {typed_value(odd)}; send a string, "
                           "a list of token ids, or a list of prompts", "prompt")
        if max_model_len is not None:  # counted before any id is checked; truncation opts in to longer lists
            truncating = body.get("truncate_prompt_tokens") is not None
            limit = MAX_CHARS_PER_TOKEN * max_model_len if truncating else max_model_len - 1
            if len(p) > limit:
                raise ApiError(f"prompt has {len(p)} tokens but the context is {max_model_len} tokens (max-model-len), "
                               + ("more than truncate_prompt_tokens takes" if truncating else
                                  "leaving no room to generate (truncate_prompt_tokens opts in to keeping its end)"),
                               "prompt")
        return _token_ids(p, "prompt", vocab_size)
    if p is None:
        raise ApiError("prompt is required (a string or a list of token ids)", "prompt")
    raise ApiError(f"prompt must be a string or a list of token ids, got {typed_value(p)}", "prompt")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(f"messages must be a non-empty list of {{role, content}} objects, got {json_value(msgs)}",
                       "messages")
    if len(msgs) > MAX_MESSAGES:
        raise ApiError(f"messages has {len(msgs)} entries, more than the limit of {MAX_MESSAGES}", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object with role and content", where)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}, got {json_value(role)}", f"{where}.role")
        for f in STRING_FIELDS:
            if m.get(f) is not None and not isinstance(m[f], str):
                raise ApiError(f"{where}.{f} must be a string, got {typed_value(m[f])}", f"{where}.{f}")
        if role == "assistant" and content in (None, "") and m.get("tool_calls"):
            from llmd.daemon.serving.structured import tool_calls_text

            content = tool_calls_text(m["tool_calls"], f"{where}.tool_calls")
        if isinstance(content, list):  # [{"type": "text", "text": ...}]
            for j, c in enumerate(content):
                part = f"{where}.content[{j}]"
                if not isinstance(c, dict) or c.get("type") != "text":
                    got = json_value(c.get("type")) if isinstance(c, dict) else json_typed(c)
                    raise ApiError(f"{part} must be a text part {{type: 'text', text: str}} (no images), got {got}",
                                   f"{where}.content")
                if not isinstance(c.get("text"), str):
                    raise ApiError(f"{part}.text must be a string, got {typed_value(c.get('text'))}",
                                   f"{where}.content")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise ApiError(f"{where}.content must be a string or a list of text parts, got {json_typed(content)}",
                           f"{where}.content")
        if not content:
            raise ApiError(f"{where}.content is empty", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role,
                    "content": check_utf8(content, f"{where}.content")})
    return out


def parse_tokens(body, vocab_size: int, max_model_len: int) -> list[int]:
    """``POST /detokenize``'s ``tokens``: a list (empty allowed) of integer token ids in
    ``[0, vocab_size)``, at most ``MAX_CHARS_PER_TOKEN`` × ``max_model_len`` of them (the most
    a prompt may carry, with ``truncate_prompt_tokens``; a reply under context shift runs past
    the context too), counted before any id is checked.

    Raises:
        ApiError: the body is not an object; ``tokens`` is missing or null, not a list, too
            long, or holds something other than an id of the vocabulary (booleans are not
            ids); ``param`` "tokens".
    """
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {json_typed(body)}")
    v = body.get("tokens")
    if v is None:
        raise ApiError("tokens is required (a list of token ids)", "tokens")
    if not isinstance(v, list):
        raise ApiError(f"tokens must be a list of token ids, got {json_typed(v)}", "tokens")
    limit = MAX_CHARS_PER_TOKEN * max_model_len
    if len(v) > limit:
        raise ApiError(f"tokens has {len(v)} ids, more than the limit of {limit} ({MAX_CHARS_PER_TOKEN} x the "
                       f"context of {max_model_len} tokens)", "tokens")
    return _token_ids(v, "tokens", vocab_size)


def parse_prompt(body, chat: bool, vocab_size: int, max_model_len: int | None = None) -> str | list[int] | list[dict]:
    """The prompt of a body: ``messages`` (``chat``) or ``prompt`` (text or token ids), with
    the limits of ``validation.parse_request`` (``POST /tokenize`` parses its body with this).

    Raises:
        ApiError: naming the field and its limit.
    """
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {json_typed(body)}")
    return _messages(body) if chat else _prompt(body, vocab_size, max_model_len)
