"""The 400 for prompt + max_tokens past the context suggests only what would be accepted: a beam
request (beams cannot shift) and a request that asked for ``context_overflow: "stop"`` on a
shifting daemon were told to use ``context_overflow "shift"`` / ``--context-overflow shift``,
which is refused for beams and is already the daemon's mode (a fresh user's finding,
2026-12-07). Token-id prompts: no tokenizer, no model."""

from __future__ import annotations

import pytest

from llmd.daemon.core.errors import RequestError
from llmd.daemon.core.input_processor import InputProcessor
from llmd.daemon.core.request import SamplingParams


def refusal(daemon_overflow: str, **params) -> str:
    proc = InputProcessor(None, 1000, 128, context_overflow=daemon_overflow, keep=32)
    with pytest.raises(RequestError) as e:
        proc.process([5] * 110, SamplingParams(**params))
    assert e.value.param == "max_tokens"
    return str(e.value)


def test_hints_name_what_would_be_accepted():
    beams = refusal("shift", max_tokens=30, use_beam_search=True, temperature=0.0)
    assert "beams stop at the context: max_tokens <= 18" in beams and "shift" not in beams
    stop = refusal("shift", max_tokens=60, context_overflow="stop")
    assert "max_tokens <= 18, or leave context_overflow out to shift as this daemon does" in stop
    assert "--context-overflow shift" not in stop
    plain = refusal("stop", max_tokens=60)
    assert "context_overflow \"shift\" or --context-overflow shift goes on past it" in plain


def test_a_shifting_daemon_takes_the_same_request_without_stop():
    proc = InputProcessor(None, 1000, 128, context_overflow="shift", keep=32)
    out = proc.process([5] * 110, SamplingParams(max_tokens=60))
    assert len(out.token_ids) == 110 and not out.max_tokens_defaulted
