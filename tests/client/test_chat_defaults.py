"""`llmd chat`'s sampling defaults (``client.chat.CHAT_DEFAULTS``) give SmolLM2-135M replies
that end by themselves: on ten everyday prompts, seeded 0..9, at least 8 finish with ``stop``
within the default reply cap (issue 17; the measurements behind the choice are in the README,
"`llmd chat`'s defaults"). One in-process float32 engine over the session's loaded model, the
ten requests batched (a request's tokens do not depend on its batch neighbours), on the session's
torch threads (the README's measurement used one; two threads pass too, in half the time)."""

from __future__ import annotations

from llmd.daemon.client.chat import CHAT_DEFAULTS
from llmd.daemon.core.request import SamplingParams

#: the README's ten prompts (the same list measured the candidates)
PROMPTS = [
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a computer virus is in simple terms.",
    "How do I boil an egg?",
    "Tell me a fun fact about space.",
    "What should I pack for a weekend camping trip?",
    "Write a haiku about autumn.",
    "Why is the sky blue?",
    "Suggest a name for a pet cat.",
]


def test_chat_defaults_end_replies_by_themselves(make_engine):
    eng = make_engine(kv_cache_memory=512 * 2**20, max_num_seqs=16)
    ids = {eng.add_request([{"role": "user", "content": p}], SamplingParams(seed=i, **CHAT_DEFAULTS)): i
           for i, p in enumerate(PROMPTS)}
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[ids[out.request_id]] = (out.finish_reason, out.num_output_tokens)
        stops = [i for i, (reason, n) in finished.items() if reason == "stop" and n <= CHAT_DEFAULTS["max_tokens"]]
        if len(stops) >= 8:  # the criterion holds: the rest need not run to their end (CI seconds)
            for rid in ids:
                eng.abort(rid)
            break
    assert len(stops) >= 8, finished
