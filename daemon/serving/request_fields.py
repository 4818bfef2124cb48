"""OpenAI request fields beyond the prompt and the sampling ranges: ``logit_bias``,
``stream_options``, and the SDK's typed parameters llmd ignores or refuses.

Policy (the README's parameter table lists every field of the ``openai`` SDK's
``CompletionCreateParams`` and chat ``CompletionCreateParamsBase``): a field llmd can honour is
honoured; a field that changes nothing about the reply (bookkeeping a router or the SDK adds:
``user``, ``metadata``, ``store``, ``service_tier``, ``safety_identifier``,
``prompt_cache_key``, ``prompt_cache_retention``, ``prompt_cache_options``,
``skip_special_tokens: true``, ``stream_options.include_obfuscation``) is
accepted and ignored; a field whose meaning llmd cannot deliver is refused with a 400 naming
it (:data:`REFUSED`), never silently dropped. Fields no SDK sends stay ignored (OpenAI-compatible
servers' convention), see ``validation.py``.

vllm-router 0.1.17 extends every body it forwards (recorded from a logging worker): completions
with ``echo``, ``no_stop_trim``, ``ignore_eos``, ``skip_special_tokens``, ``return_hidden_states``;
chat with ``logprobs``, ``no_stop_trim``, ``ignore_eos``, ``continue_final_message``,
``skip_special_tokens``, ``separate_reasoning``, ``stream_reasoning``, ``return_hidden_states``,
``include_reasoning``, each at its default (false; ``skip_special_tokens``, the reasoning
flags: true). The defaults are accepted; ``return_hidden_states``, ``no_stop_trim`` and
``continue_final_message`` set to true are refused (:data:`REFUSED`); the reasoning flags
change nothing for llmd's models (they do not reason) and are ignored either way.

``logit_bias`` follows OpenAI's API reference: an object of token id (a decimal string key)
→ bias in [-100, 100], at most ``MAX_LOGIT_BIAS`` (300) entries, ids in the vocabulary.
``stream_options.continuous_usage_stats`` is vLLM's: with ``include_usage``, every chunk
carries the usage of its choice so far (``prompt_tokens`` of its prompt, ``completion_tokens``
of that choice; vLLM's ``serving_completion.py`` / ``serving_chat.py``); without
``include_usage`` it does nothing, as in vLLM.
"""

from __future__ import annotations

from llmd.daemon.serving.json_fields import finite_number
from llmd.daemon.serving.validation import MAX_LOGIT_BIAS, ApiError, json_typed, json_value

#: field → (endpoints it is refused on, why); refused when present and not null / false / empty
REFUSED: dict[str, tuple[tuple[str, ...], str]] = {
    "suffix": (("completions",), "suffix (text after the completion, insertion) is not supported by llmd"),
    "functions": (("chat",), "functions is deprecated and not supported by llmd; send tools"),
    "function_call": (("chat",), "function_call is deprecated and not supported by llmd; send tool_choice"),
    "audio": (("chat",), "audio output is not supported by llmd (text only)"),
    "prediction": (("chat",), "prediction (predicted outputs) is not supported by llmd"),
    "reasoning_effort": (("chat",), "reasoning_effort is not supported by llmd (its models do not reason)"),
    "verbosity": (("chat",), "verbosity is not supported by llmd"),
    "web_search_options": (("chat",), "web search is not available in llmd"),
    "moderation": (("chat",), "moderation is not available in llmd"),
    # vllm-router (0.1.17) adds these to every body it forwards, false by default: accepted then
    "return_hidden_states": (("completions", "chat"), "return_hidden_states is not supported by llmd (its replies "
                             "carry no hidden states)"),
    "no_stop_trim": (("completions", "chat"), "no_stop_trim (keep the matched stop string in the text) is not "
                     "supported by llmd: stop strings are always trimmed"),
    "continue_final_message": (("chat",), "continue_final_message is not supported by llmd: the chat template "
                               "always opens a new assistant turn"),
}
EMPTY = (None, False, "", [], {})


def check_refused(body: dict, chat: bool) -> None:
    """Refuse the typed SDK parameters llmd cannot honour (:data:`REFUSED`, ``modalities``
    other than ``["text"]``, ``skip_special_tokens: false``).

    Raises:
        ApiError: 400 naming the field.
    """
    endpoint = "chat" if chat else "completions"
    for name, (where, why) in REFUSED.items():
        if endpoint in where and body.get(name) not in EMPTY:
            raise ApiError(why, name)
    if chat and body.get("modalities") not in (None, [], ["text"]):
        got = json_value(body["modalities"], 60)
        raise ApiError(f"modalities must be [\"text\"] (llmd answers text only), got {got}", "modalities")
    if body.get("skip_special_tokens") is False:
        raise ApiError("skip_special_tokens: false is not supported; llmd always leaves special tokens out of "
                       "the text", "skip_special_tokens")


def parse_logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """``logit_bias`` as token id → bias (None when absent or empty).

    Raises:
        ApiError: not an object, over ``MAX_LOGIT_BIAS`` entries (said before any entry is
            read), a key that is not a decimal token id, an id outside ``[0, vocab_size)``, or
            a bias that is not a number in [-100, 100]; ``param`` is ``logit_bias``.
    """
    bias = body.get("logit_bias")
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise ApiError(f"logit_bias must be an object of token id → bias, got {json_typed(bias)}", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(f"logit_bias has {len(bias)} entries, more than the limit of {MAX_LOGIT_BIAS}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(f"logit_bias keys must be token ids (decimal strings), got {json_value(key)}", "logit_bias")
        token = int(key)
        if token >= vocab_size:
            raise ApiError(f"logit_bias has token id {token} outside the vocabulary [0, {vocab_size})", "logit_bias")
        if not finite_number(value) or not -100 <= value <= 100:
            raise ApiError(f"logit_bias[{json_value(key)}] must be a number in [-100, 100], got {json_value(value)}",
                           "logit_bias")
        out[token] = float(value)
    return out


def parse_stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage_stats)`` of ``stream_options`` (both False when absent).

    Raises:
        ApiError: ``stream_options`` without ``stream: true``, not an object, or a field that
            is not a boolean; ``param`` names it.
    """
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not stream:
        raise ApiError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(opts, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        v = opts.get(name)
        if v is not None and not isinstance(v, bool):
            raise ApiError(f"stream_options.{name} must be a boolean, got {json_typed(v)}", f"stream_options.{name}")
        flags.append(bool(v))
    return flags[0], flags[0] and flags[1]
