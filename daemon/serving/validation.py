"""Validate OpenAI-style request bodies and turn them into engine inputs: :func:`parse_request`
and the sampling fields (ranges, ``stop``, ``stop_token_ids``, beam search, ``cache_salt``).

The prompt (``prompt`` or ``messages``) is parsed by ``prompt_fields.py``; :class:`ApiError` and
the typed field readers are ``json_fields.py``'s (re-exported here: the other request parsers
import them from this module). Every rejection is an :class:`ApiError` (HTTP 400 unless stated)
whose message names the field and the allowed range, so a client sees ``{"error": {"message": "max_tokens must be
an integer >= 1 (got 0)", "param": "max_tokens", ...}}``. Checks that need the tokenized
prompt (too long for the context, can never fit the KV pool) are the engine's
(:class:`LlmdError`) and are mapped to 400 by the server.

Ranges follow the OpenAI API where it has one (temperature 0–2, penalties −2–2,
logprobs/top_logprobs 0–20) and vLLM's extras otherwise (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids). Unknown fields are ignored, as OpenAI
clients send extras (``user``, ``metadata``); the SDK's typed fields llmd cannot honour
(``best_of`` > n, ``suffix``, ``functions``, ``echo`` with ``logprobs``, ...) are rejected
rather than silently dropped (``request_fields.py``; ``logit_bias`` and ``stream_options``
are parsed there too, a list of prompts and ``echo`` in ``multi_prompt.py``). An unknown
``model`` is a 404 with OpenAI's ``code: "model_not_found"`` (:func:`check_model`). Output
constraints (``response_format``, ``structured_outputs`` / ``guided_*``, ``tools`` +
``tool_choice``) are parsed by ``structured.py``.

Size limits are checked here, on the event loop, before anything is tokenized or queued, and
each is checked by counting *before* any per-element pass (a body of a million token ids is
refused in microseconds): token-id prompts of ``max_model_len`` or more tokens (no room to
generate), more than ``prompt_fields.MAX_MESSAGES`` chat messages (OpenAI's cap, 2048; 20k short messages
would hold the GIL ~135 ms in the chat template), more than ``MAX_STOP`` stop strings or one
longer than ``MAX_STOP_CHARS`` characters, more than ``MAX_STOP_TOKEN_IDS`` stop token ids
(deduplicated: the scheduler keeps them as a set), more than ``MAX_LOGIT_BIAS`` ``logit_bias``
entries (OpenAI's 300), and more than ``multi_prompt.MAX_PROMPTS`` prompts (64).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmd.daemon.core.request import SamplingParams
from llmd.daemon.serving.json_fields import ApiError, _bool, _float, _int, check_utf8, json_typed, json_value
from llmd.daemon.serving.prompt_fields import _prompt, _token_ids, parse_prompt

MAX_N = 16
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit)
MAX_LOGPROBS = 20


@dataclass
class ParsedRequest:
    """A validated request.

    Attributes:
        chat: True for /v1/chat/completions (``prompt`` is then the message list).
        prompt: text, token ids, or chat messages.
        params: sampling parameters shared by the ``n`` sequences.
        cache_salt: optional prefix-cache salt (requests with different salts share no KV).
        priority: scheduling priority, lower first (vLLM's convention); default 0.
        n: independent sequences of the prompt, all with ``params`` (and its seed): sequence
            ``i`` draws from generators derived from (seed, i, output position) (``sampler.row_seed``).
        stream, include_usage: SSE streaming and a final usage chunk.
        logprobs: top logprobs per token (0 = only the chosen token), None = no logprobs.
        tool_calling: set when ``tool_choice`` asks for a tool call (``structured.py``): the
            reply is reported as ``tool_calls``; ``params.structured`` holds the constraint.
        prompts: every prompt of a /v1/completions batch (``prompt`` is the first), or None.
        echo: prepend each prompt's text to its choices (``multi_prompt.py``).
        continuous_usage: ``stream_options.continuous_usage_stats``: usage in every chunk.
    """

    chat: bool
    prompt: str | list[int] | list[dict]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    tokens_as_ids: bool = False
    cache_salt: str | None = None
    priority: int = 0
    tool_calling: object | None = None  # a structured.ToolCalling
    prompts: list | None = None
    echo: bool = False
    continuous_usage: bool = False


def check_model(body: dict, model_ids: tuple[str, ...]) -> None:
    """``model``, when present and not null, is one of ``model_ids``; else a 404 with OpenAI's
    ``code: "model_not_found"`` (generation, render, ``/detokenize``)."""
    model = body.get("model")
    if model is not None and model not in model_ids:
        raise ApiError(f"model {json_value(model)} is not served here; available: {', '.join(model_ids)}", "model",
                       404, code="model_not_found")


def parse_request(body, chat: bool, model_ids: tuple[str, ...], vocab_size: int,
                  max_model_len: int | None = None) -> ParsedRequest:
    """Validate a /v1/completions (``chat=False``) or /v1/chat/completions body.

    Args:
        body: the decoded JSON (any type; a non-object is rejected).
        model_ids: names accepted in ``model`` (a missing ``model`` means the served one).
        vocab_size: token ids must lie in [0, vocab_size).
        max_model_len: the context in tokens; a token-id prompt of this many tokens or more
            is refused before its ids are checked (None: left to the engine).
    Raises:
        ApiError: naming the field and its limit.
    """
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {json_typed(body)}")
    check_model(body, model_ids)
    from llmd.daemon.serving.multi_prompt import check_echo, parse_prompts  # they import this module's ApiError
    from llmd.daemon.serving.request_fields import check_refused, parse_logit_bias, parse_stream_options
    from llmd.daemon.serving.structured import parse_structured

    check_refused(body, chat)
    structured, tool_calling = parse_structured(body, chat)
    prompts = None if chat else parse_prompts(body, lambda b: _prompt(b, vocab_size, max_model_len))
    prompt = prompts[0] if prompts else parse_prompt(body, chat, vocab_size, max_model_len)
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise ApiError(f"best_of must equal n ({n}); llmd does not rank sequences", "best_of")
    max_tokens = _int(body, "max_tokens", None)
    mct = _int(body, "max_completion_tokens", None)
    field = "max_tokens"
    if mct is not None:
        if max_tokens is not None and max_tokens != mct:
            raise ApiError(f"max_tokens ({max_tokens}) and max_completion_tokens ({mct}) disagree; send one",
                           "max_tokens")
        max_tokens, field = mct, "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"{field} must be an integer >= 1 (got {max_tokens}); omit it for the remaining context", field)
    stop, stop_ids = _stop(body), _stop_token_ids(body, vocab_size)
    logit_bias = parse_logit_bias(body, vocab_size)
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
    if chat:
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise ApiError("top_logprobs requires logprobs: true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = check_echo(body, chat, logprobs)
    stream = _bool(body, "stream")
    beam = _bool(body, "use_beam_search")
    if beam and stream:
        raise ApiError("use_beam_search cannot stream (beams change until the search ends); send stream: false",
                       "stream")
    include_usage, continuous_usage = parse_stream_options(body, stream)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 0.0 if beam else 1.0, 0.0, 2.0),
        top_k=_int(body, "top_k", 0, -1, None),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        seed=seed, stop=stop, stop_token_ids=stop_ids, min_tokens=_int(body, "min_tokens", 0, 0, None),
        ignore_eos=_bool(body, "ignore_eos"), logprobs=logprobs, structured=structured, logit_bias=logit_bias,
        use_beam_search=beam, length_penalty=_float(body, "length_penalty", 1.0, -100.0, 100.0),
        early_stopping=_early_stopping(body),
        context_overflow=_context_overflow(body, beam), n_keep=_int(body, "n_keep", None, -1, None),
        truncate_prompt_tokens=_int(body, "truncate_prompt_tokens", None, -1, None),
    )
    if beam:
        from llmd.daemon.core.beam import check_beam_params
        from llmd.daemon.core.errors import RequestError

        try:
            check_beam_params(params, n)
        except RequestError as e:
            raise ApiError(str(e), e.param) from None
    return ParsedRequest(chat=chat, prompt=prompt, params=params, n=n, stream=stream, tool_calling=tool_calling,
                         include_usage=include_usage, logprobs=logprobs,
                         tokens_as_ids=_bool(body, "return_tokens_as_token_ids"), cache_salt=_cache_salt(body),
                         priority=_int(body, "priority", 0, -(2**31), 2**31 - 1), prompts=prompts, echo=echo,
                         continuous_usage=continuous_usage)


def _context_overflow(body: dict, beam: bool) -> str | None:
    """llmd's per-request ``context_overflow``: "stop", "shift" or absent (the daemon's
    ``--context-overflow``); "shift" with ``use_beam_search`` is a 400."""
    v = body.get("context_overflow")
    if v is not None and v not in ("stop", "shift"):
        raise ApiError(f"context_overflow must be \"stop\" or \"shift\", got {json_value(v)}", "context_overflow")
    if v == "shift" and beam:
        raise ApiError("context_overflow \"shift\" does not combine with use_beam_search", "context_overflow")
    return v


def _early_stopping(body: dict) -> bool | str:
    """vLLM's beam-search ``early_stopping``: true, false (default) or "never"."""
    v = body.get("early_stopping", False)
    if not (isinstance(v, bool) or v == "never"):
        raise ApiError(f"early_stopping must be true, false or \"never\", got {json_value(v)}", "early_stopping")
    return v


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, got "
                       f"{json_value(body.get('stop'))}", "stop")
    for s in stop:
        if len(s) > MAX_STOP_CHARS:
            raise ApiError(f"stop has a string of {len(s)} characters, more than the limit of {MAX_STOP_CHARS}",
                           "stop")
        check_utf8(s, "stop")
    return stop


def _stop_token_ids(body: dict, vocab_size: int) -> list[int]:
    """Distinct stop token ids, in first-seen order (the scheduler keeps them as a set)."""
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list):
        raise ApiError("stop_token_ids must be a list of token ids", "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(f"stop_token_ids has {len(ids)} entries, more than the limit of {MAX_STOP_TOKEN_IDS}",
                       "stop_token_ids")
    return list(dict.fromkeys(_token_ids(ids, "stop_token_ids", vocab_size)))


def _cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > 1024:
        got = f"a string of {len(salt)} characters" if isinstance(salt, str) and salt else json_typed(salt)
        raise ApiError(f"cache_salt must be a non-empty string of at most 1024 characters, got {got}", "cache_salt")
    return check_utf8(salt, "cache_salt")
