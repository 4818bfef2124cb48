"""Structured outputs in the engine (real SmolLM2, float32): grammar-constrained rows under
batching, n > 1 forks, preemption by recompute and prefix-cache hits; every constrained output
parses and validates with ``jsonschema``, unconstrained neighbours are unchanged, logprobs stay
those of the raw (unmasked) distribution."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_engine_scheduling import smol_pool

from llmd.daemon.core.errors import RequestError
from llmd.daemon.core.grammar import GrammarSpec
from llmd.daemon.core.request import SamplingParams

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "address"]}
RATING = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "score": {"type": "number", "minimum": 0, "maximum": 10}},
          "required": ["color", "score"]}
PRIMES = {"type": "object", "properties": {"primes": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 100},
                                                      "minItems": 2, "maxItems": 4}},
          "required": ["primes"]}
CASES = [(PERSON, "Describe a person who lives in Paris as JSON."),
         (RATING, "Rate the colour of the sky as JSON."),
         (PRIMES, "List a few prime numbers as JSON.")]


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat([{"role": "user", "content": text}])


def constrained(schema, max_tokens=64, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured=GrammarSpec.json_schema(schema, "x"), **kw)


def run(engine, items) -> dict:
    """Run (request id, prompt ids, params, n) items together; id → {child id: [tokens, text,
    finish, first token's logprobs]}."""
    got = {}
    for rid, ids, params, n in items:
        children = engine.add_parallel_request(ids, params, [f"{rid}-{i}" for i in range(n)])
        got[rid] = {c: [[], "", None, None] for c in children}
    owner = {c: rid for rid, cs in got.items() for c in cs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            r = got[owner[o.request_id]][o.request_id]
            if not r[0]:
                r[3] = o.logprobs[0] if o.logprobs else None
            r[0] += o.new_token_ids
            r[1] += o.new_text
            r[2] = o.finish_reason
    return got


def valid(text: str, schema) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def free_items(tok):
    return [("a", chat(tok, CASES[0][1]), SamplingParams(max_tokens=12, temperature=0, logprobs=5), 1),
            ("b", chat(tok, "Name a colour."), SamplingParams(max_tokens=12, temperature=0.8, seed=3), 1)]


@pytest.fixture(scope="module")
def batched(make_engine, smollm2_tokenizer):
    """(engine, the two free requests alone, the three constrained ones and the free ones in one batch)."""
    eng = make_engine()
    tok = smollm2_tokenizer
    solo = run(eng, free_items(tok))
    items = [(f"c{i}", chat(tok, p), constrained(s, logprobs=5 if i == 0 else None), 1)
             for i, (s, p) in enumerate(CASES)]
    return eng, solo, run(eng, items + free_items(tok))


def test_schemas_in_one_batch_with_unconstrained_neighbours(batched):
    """Three schemas (nested object + pattern, enum + number, bounded array) and two free
    requests in the same steps: each constrained reply validates and stops at its grammar's end;
    the free ones' tokens equal their solo runs; the constrained row's logprobs at its first
    token are the free distribution's (raw, pre-mask), though the mask changed its choice."""
    _, solo, got = batched
    for i, (schema, _) in enumerate(CASES):
        tokens, text, finish, _ = got[f"c{i}"][f"c{i}-0"]
        assert finish == "stop", (text, finish)
        valid(text, schema)
    for rid in ("a", "b"):
        assert got[rid][f"{rid}-0"][0] == solo[rid][f"{rid}-0"][0]
    masked, raw = got["c0"]["c0-0"], solo["a"]["a-0"]
    assert masked[0][0] != raw[0][0]  # the mask changed the first token ...
    assert [t for t, _ in masked[3].top] == [t for t, _ in raw[3].top]  # ... not the reported distribution
    assert [v for _, v in masked[3].top] == pytest.approx([v for _, v in raw[3].top], abs=1e-4)
    assert masked[3].logprob < raw[3].logprob  # the chosen token's own raw logprob, not the masked 0-ish


def test_n_siblings_each_validate_with_their_own_matcher(make_engine, smollm2_tokenizer):
    """n = 3 sampled (temperature 0.9, one seed): every sibling's reply validates; each holds its
    own matcher (forked from the leader's prompt, never shared)."""
    eng = make_engine()
    params = SamplingParams(max_tokens=64, temperature=0.9, seed=11, structured=GrammarSpec.json_schema(RATING, "x"))
    ids = eng.add_parallel_request(chat(eng.tokenizer, CASES[1][1]), params, ["n-0", "n-1", "n-2"])
    matchers = {id(eng.requests[i].grammar) for i in ids}
    assert len(matchers) == 3 and None not in {eng.requests[i].grammar for i in ids}
    texts = {i: "" for i in ids}
    finish = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            texts[o.request_id] += o.new_text
            finish[o.request_id] = o.finish_reason
    for i in ids:
        assert finish[i] == "stop", texts[i]
        valid(texts[i], RATING)


def test_preempted_and_prefix_cached_constrained_requests_validate(make_engine, smollm2_tokenizer, batched):
    """A pool of 8 blocks for three constrained requests of ~60-80 tokens each: at least one is
    preempted and recomputed (its matcher keeps its place: the output tokens stay), and every
    reply equals its large-pool reply and validates; a repeat of one prompt on the large pool
    hits the prefix cache and gives the same reply."""
    tok = smollm2_tokenizer
    large, _, ref = batched
    items = [(f"c{i}", chat(tok, p), constrained(s), 1) for i, (s, p) in enumerate(CASES)]
    small = make_engine(kv_cache_memory=smol_pool(8), max_num_batched_tokens=64)
    got = run(small, items)
    assert small.scheduler.num_preemptions >= 1
    for i, (schema, _) in enumerate(CASES):
        assert got[f"c{i}"][f"c{i}-0"][:3] == ref[f"c{i}"][f"c{i}-0"][:3]
        valid(got[f"c{i}"][f"c{i}-0"][1], schema)
    hits = large.kv_manager.prefix_cache_hits
    again = run(large, [("again", items[1][1], constrained(RATING), 1)])
    assert large.kv_manager.prefix_cache_hits > hits
    assert again["again"]["again-0"][:3] == ref["c1"]["c1-0"][:3]


def test_regex_choice_grammar_length_cut_and_bad_specs(make_engine, smollm2_tokenizer):
    """Regex, choice and EBNF constraints hold; a length cut returns the truncated text with
    finish "length"; a grammar that completes under ignore_eos still stops; a schema, regex or
    grammar xgrammar cannot compile is a RequestError naming its field, and nothing is queued."""
    eng = make_engine()
    prompt = chat(smollm2_tokenizer, "What is the date today?")
    specs = {"regex": GrammarSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
             "choice": GrammarSpec("choice", choices=("yes", "no", "maybe")),
             "grammar": GrammarSpec("grammar", 'root ::= "The answer is " [0-9]+ "."')}
    outs = eng.generate([prompt] * 3, [SamplingParams(max_tokens=20, temperature=0, structured=s,
                                                      ignore_eos=k == "choice") for k, s in specs.items()])
    assert [o["finish_reason"] for o in outs] == ["stop"] * 3
    import re

    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", outs[0]["text"])
    assert outs[1]["text"] in ("yes", "no", "maybe")
    assert re.fullmatch(r"The answer is [0-9]+\.", outs[2]["text"])
    full = eng.generate([chat(smollm2_tokenizer, CASES[0][1])], constrained(PERSON))[0]
    cut = eng.generate([chat(smollm2_tokenizer, CASES[0][1])], constrained(PERSON, max_tokens=5))[0]
    assert cut["finish_reason"] == "length" and full["text"].startswith(cut["text"]) and len(cut["token_ids"]) == 5
    for spec in (GrammarSpec.json_schema({"type": "frobnicate"}, "response_format.json_schema.schema"),
                 GrammarSpec("regex", "([a-z", param="guided_regex"), GrammarSpec("grammar", "root ::= ", param="g")):
        with pytest.raises(RequestError) as e:
            eng.add_request(prompt, SamplingParams(max_tokens=4, structured=spec))
        assert e.value.param == spec.param and spec.param in str(e.value)
    assert not eng.has_unfinished_requests()


def test_a_grammar_completed_at_max_tokens_stops(make_engine, smollm2_tokenizer):
    """A reply whose grammar completes on its max_tokens-th token (nothing but the stop token
    could follow) ends with "stop", as with one more token of budget; a grammar that could go on
    (a regex that matched but allows more) still ends with "length"."""
    eng = make_engine()
    prompt = chat(smollm2_tokenizer, "Pick a fruit.")
    choice = GrammarSpec("choice", choices=("apple", "banana"))
    roomy = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0, structured=choice))[0]
    n = len(roomy["token_ids"]) - 1  # the text's tokens; the last one is the stop token
    assert roomy["finish_reason"] == "stop" and n >= 1
    exact = eng.generate([prompt], SamplingParams(max_tokens=n, temperature=0, structured=choice))[0]
    assert exact["finish_reason"] == "stop" and exact["text"] == roomy["text"], exact
    more = GrammarSpec("regex", "[0-9]+")
    cut = eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0, structured=more))[0]
    assert cut["finish_reason"] == "length" and len(cut["token_ids"]) == 2


def test_min_tokens_yields_to_a_completed_grammar(make_engine, smollm2_tokenizer):
    """min_tokens past a grammar's end: the choice still ends with its stop token (the grammar's
    mask stands when it allows nothing else) instead of a row with no token left to sample."""
    eng = make_engine()
    prompt = chat(smollm2_tokenizer, "Pick a fruit.")
    choice = GrammarSpec("choice", choices=("apple", "banana"))
    plain = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0, structured=choice))[0]
    held = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0, structured=choice, min_tokens=10))[0]
    assert held["finish_reason"] == "stop" and held["text"] == plain["text"] in ("apple", "banana"), held
    assert eng.kv_manager.num_used_blocks == 0


def test_device_sampler_masks_only_constrained_rows(batched):
    """The batched (CUDA-path) sampler, run on CPU tensors: constrained rows draw only allowed
    tokens, as the host sampler does; the free row's token is its plain argmax; logprobs are raw."""
    import torch

    from llmd.daemon.core.device_sampler import sample_on_device
    from llmd.daemon.core.grammar import GrammarState
    from llmd.daemon.core.request import Request
    from llmd.daemon.core.sampler import Sampler, constrained_masks

    eng = batched[0]
    compiled = eng.grammars.compile(GrammarSpec("choice", choices=("yes", "no")))
    vocab = eng.model_config.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(temperature=0.0 if i < 2 else 0.7, seed=i, logprobs=2),
                    grammar=None if i == 1 else GrammarState(compiled)) for i in range(3)]
    masks = constrained_masks(reqs, vocab)
    assert sorted(masks) == [0, 2] and int(masks[0].sum()) < vocab
    dev, host = sample_on_device(logits, reqs, masks), Sampler()(logits, reqs)
    assert not dev.failed and not host.failed
    assert dev.sampled_token_ids[0] == host.sampled_token_ids[0] == int(logits[0].masked_fill(~masks[0], -1e9).argmax())
    assert dev.sampled_token_ids[1] == int(logits[1].argmax())
    assert bool(masks[2][dev.sampled_token_ids[2]]) and bool(masks[2][host.sampled_token_ids[2]])
    raw = torch.log_softmax(logits[0], -1)
    assert dev.logprobs[0].logprob == pytest.approx(float(raw[dev.sampled_token_ids[0]]), abs=1e-5)
    assert [t for t, _ in dev.logprobs[0].top] == torch.topk(raw, 2).indices.tolist()
