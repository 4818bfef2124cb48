"""The OpenAI-style API of a real daemon (subprocess): shapes, validation, cases A3-A8."""

from __future__ import annotations

import json
import math
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmd.daemon.client.client import ApiResponseError
from llmd.daemon.protocol import STATS_SCHEMA_VERSION, rle, rle_to_cells

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def expect_400(fn, *words):
    with pytest.raises(ApiResponseError) as ei:
        fn()
    assert ei.value.status == 400, ei.value.body
    for w in words:
        assert w in ei.value.message, ei.value.message
    return ei.value


def stream_all(client, path, body):
    chunks = list(client.stream(path, body))
    return chunks


def test_models_health_and_stats_schema(llmd_daemon):
    c = llmd_daemon.client()
    assert c.health()["status"] == "ok"
    assert c.models()["data"][0]["id"] == "smollm2-135m"
    # one served name (issue 17): /health's accepted names are /v1/models' ids, and an unknown
    # model's error lists exactly those, never the GGUF's general.name
    assert c.health()["model_ids"] == [m["id"] for m in c.models()["data"]] == ["smollm2-135m"]
    with pytest.raises(ApiResponseError) as ei:
        c.chat(messages=[{"role": "user", "content": "Hi"}], max_tokens=1, model="nope")
    assert ei.value.body["error"]["message"].endswith("available: smollm2-135m"), ei.value.body
    assert "llmd: loaded smollm2-135m in " in llmd_daemon.log_text() and "Smollm2 135M" not in llmd_daemon.log_text()
    s = c.stats()
    assert s["schema_version"] == STATS_SCHEMA_VERSION
    kv = s["kv_cache"]
    assert kv["used"] + kv["free"] + kv["cached_free"] == kv["total"] == kv["num_blocks"] - 1
    assert sum(n for _, n in s["block_map"]["runs"]) == kv["num_blocks"]
    cells = c.stats(cells=7)["block_map"]
    assert cells["encoding"] == "cells" and len(cells["cells"]) == 7
    expect_400(lambda: c.request("GET", "/v1/stats?cells=zero"), "cells")
    with pytest.raises(ApiResponseError) as ei:
        c.abort("no-such-request")
    assert ei.value.status == 404


def test_block_map_aggregation():
    states = ["null"] + ["used"] * 5 + ["free"] * 4 + ["used"] * 2
    runs = rle(states)
    assert runs == [["null", 1], ["used", 5], ["free", 4], ["used", 2]]
    assert rle_to_cells(runs, 12) == [0.0] + [1.0] * 5 + [0.0] * 4 + [1.0] * 2
    assert rle_to_cells(runs, 2) == [5 / 6, 2 / 6]
    assert rle_to_cells(runs, 1) == [7 / 12]


def test_completion_shapes_and_n_seeds(llmd_daemon):
    c = llmd_daemon.client()
    r = c.completion(prompt="The capital of France is", max_tokens=6, temperature=0)
    assert "Paris" in r["choices"][0]["text"]
    assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    body = dict(prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    a, b = c.completion(**body), c.completion(**body)
    texts = [ch["text"] for ch in a["choices"]]
    assert texts == [ch["text"] for ch in b["choices"]]  # seeded: reproducible
    assert len(set(texts)) > 1  # independent sequences: draws keyed by (seed, sibling, position)
    assert a["usage"]["completion_tokens"] == 24 and a["usage"]["prompt_tokens"] == 4  # prompt counted once
    solo = c.completion(**{**body, "n": 1})
    assert solo["choices"][0]["text"] == texts[0]  # sibling 0 draws like a lone request


def test_a3_user_stop_adds_to_eos(llmd_daemon):
    r = llmd_daemon.client().chat(messages=QUESTION, stop=["\nObservation"], max_tokens=200, temperature=0)
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < 50
    assert "Paris" in ch["message"]["content"]
    for frag in ("<|im_end|>", "<|im", "im_end"):
        assert frag not in ch["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_a4_max_tokens_zero_and_one(llmd_daemon, stream, n):
    c = llmd_daemon.client()
    body = dict(prompt="Hello there", n=n, temperature=0.7, seed=1, logprobs=0)
    for field in ("max_tokens", "max_completion_tokens"):
        if stream:
            expect_400(lambda: stream_all(c, "/v1/completions", {**body, field: 0}), field, ">= 1")
        else:
            expect_400(lambda: c.completion(**body, **{field: 0}), field, ">= 1")
    if stream:
        chunks = stream_all(c, "/v1/completions", {**body, "max_tokens": 1, "stream_options": {"include_usage": True}})
        per_index = {}
        for ch in chunks[:-1]:
            for choice in ch["choices"]:
                per_index[choice["index"]] = per_index.get(choice["index"], 0) + len(choice["logprobs"]["tokens"])
        assert per_index == {i: 1 for i in range(n)}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == n
    else:
        r = c.completion(**body, max_tokens=1)
        assert [len(ch["logprobs"]["tokens"]) for ch in r["choices"]] == [1] * n
        assert all(ch["finish_reason"] in ("length", "stop") for ch in r["choices"])
    llmd_daemon.wait_idle()


def test_a5_empty_prompts(llmd_daemon):
    c = llmd_daemon.client()
    expect_400(lambda: c.completion(prompt="", max_tokens=4), "prompt", "empty")
    expect_400(lambda: c.completion(prompt=[], max_tokens=4), "prompt", "empty")
    expect_400(lambda: c.chat(messages=[{"role": "user", "content": ""}], max_tokens=4), "messages[0].content", "empty")
    r = c.completion(prompt="The capital of France is", max_tokens=4, temperature=0)
    assert "Paris" in r["choices"][0]["text"]
    llmd_daemon.wait_idle()


def test_a6_too_long_while_another_request_runs(llmd_small_daemon):
    c = llmd_small_daemon.client()
    inflight = dict(prompt="The history of the Roman Empire", max_tokens=48, temperature=0, ignore_eos=True)
    solo = c.completion(**inflight)["choices"][0]["text"]
    result = {}
    t = threading.Thread(target=lambda: result.update(r=c.completion(**inflight)))
    t.start()
    ids = c.tokenize("word " * 2100)
    expect_400(lambda: c.completion(prompt=ids[:2049], max_tokens=1), "2049", "2048")
    expect_400(lambda: c.completion(prompt=ids[:2000], max_tokens=100), "2000", "100", "2048")
    conn, resp = c._send("POST", "/v1/completions", {"prompt": ids[:2047], "max_tokens": 1, "stream": True})
    assert resp.status == 200  # accepted (headers only; closing aborts it, so the prefill below runs once)
    conn.close()
    # A4 too: no max_tokens means the remaining context (2048 - 2047 = 1 token here), never 0
    r = c.completion(prompt=ids[:2047], temperature=0, ignore_eos=True)
    assert r["choices"][0]["finish_reason"] == "length"
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]  # what the aborted prefill left in the prefix cache
    assert cached % 16 == 0 and 0 <= cached <= 2032
    assert r["usage"] == {"prompt_tokens": 2047, "completion_tokens": 1, "total_tokens": 2048,
                          "prompt_tokens_details": {"cached_tokens": cached}}
    t.join()
    assert result["r"]["choices"][0]["text"] == solo
    llmd_small_daemon.wait_idle()


def test_a7_logprobs_are_raw_model_distribution(llmd_daemon, hf_smollm2):
    from concurrent.futures import ThreadPoolExecutor

    import torch

    c = llmd_daemon.client()
    prompt = c.tokenize("The quick brown fox")
    combos = [(t, p) for t in (0.0, 0.7, 1.5) for p in (1.0, 0.5)]

    def run(combo):  # the six requests run concurrently (one batch)
        return c.completion(prompt=prompt, max_tokens=16, temperature=combo[0], top_p=combo[1], seed=3,
                            logprobs=5, ignore_eos=True, return_tokens_as_token_ids=True)

    with ThreadPoolExecutor(len(combos)) as pool:
        results = list(pool.map(run, combos))
    for (temperature, _), r in zip(combos, results):
        lp = r["choices"][0]["logprobs"]
        out = [int(t.split(":")[1]) for t in lp["tokens"]]
        with torch.no_grad():
            logits = hf_smollm2(torch.tensor([prompt + out])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)
        for i, tok in enumerate(out):
            top = lp["top_logprobs"][i]
            assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-4
            assert abs(lp["token_logprobs"][i] - float(ref[i, tok])) < 1e-3
            if temperature == 0:
                assert tok == int(ref[i].argmax())
                assert max(top, key=top.get) == f"token_id:{tok}"


def test_a8_token_id_prompt_ignore_eos_include_usage(llmd_daemon):
    c = llmd_daemon.client()
    text = "The capital of France is"
    ids = c.tokenize(text)
    body = dict(max_tokens=12, temperature=0, ignore_eos=True, stream_options={"include_usage": True})
    by_text = stream_all(c, "/v1/completions", {**body, "prompt": text})
    by_ids = stream_all(c, "/v1/completions", {**body, "prompt": ids})
    join = lambda chunks: "".join(ch["text"] for k in chunks for ch in k["choices"])  # noqa: E731
    assert join(by_text) == join(by_ids) and "Paris" in join(by_ids)
    for chunks in (by_text, by_ids):
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        assert chunks[-1]["usage"]["prompt_tokens"] == len(ids)
        assert all(k["usage"] is None for k in chunks[:-1])


def test_chat_stream_equals_non_stream(llmd_daemon):
    c = llmd_daemon.client()
    body = dict(messages=QUESTION, max_tokens=24, temperature=0)
    whole = c.chat(**body)
    chunks = stream_all(c, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


# ---- malformed-request sweep -------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=8), st.lists(st.integers(-3, 60000), max_size=3))
fields = st.sampled_from(["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                          "top_k", "min_p", "n", "stop", "seed", "logprobs", "top_logprobs", "stream",
                          "stream_options", "model", "ignore_eos", "stop_token_ids", "best_of", "echo",
                          "frequency_penalty", "repetition_penalty"])
bodies = st.one_of(
    st.dictionaries(fields, scalars, max_size=6),
    st.builds(lambda extra: {"prompt": "Hi", **extra}, st.dictionaries(fields, scalars, max_size=3)),
    st.builds(lambda extra: {"messages": [{"role": "user", "content": "Hi"}], **extra},
              st.dictionaries(fields, scalars, max_size=3)),
    st.binary(max_size=40),
    st.lists(scalars, max_size=3),
)


def _clamp_valid(body):
    """Keep bodies that might be valid cheap: any integer max_tokens > 4 becomes 4, and
    a missing one is forced to an invalid 0 (never the remaining context)."""
    if isinstance(body, dict):
        for k in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(k), int) and not isinstance(body.get(k), bool) and body[k] > 4:
                body[k] = 4
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 0
        if body.get("n") is not None and isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
    return body


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_malformed_request_sweep(llmd_daemon, body):
    c = llmd_daemon.client(timeout=60)
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    raw = body if isinstance(body, bytes) else json.dumps(_clamp_valid(body), allow_nan=True).encode()
    try:
        if isinstance(body, dict) and body.get("stream") is True:
            list(c.stream(path, json.loads(raw)))
        else:
            c.request("POST", path, raw)
    except ApiResponseError as e:
        assert 400 <= e.status < 500, (e.status, e.body)
        assert e.message


def test_after_sweep_daemon_serves_and_holds_no_blocks(llmd_daemon):
    r = llmd_daemon.client().completion(prompt="The capital of France is", max_tokens=4, temperature=0)
    assert "Paris" in r["choices"][0]["text"]
    st_ = llmd_daemon.wait_idle()
    assert st_["kv_cache"]["used"] == 0
    assert "Traceback" not in llmd_daemon.log_text()


def test_chat_with_a_running_daemon_of_another_model_is_a_clear_error(llmd_daemon):
    """`llmd chat -m X` talking to a daemon that serves Y: a one-line error naming both (not a
    silent chat with Y); other engine options given to a running daemon get a one-line note."""
    from click.testing import CliRunner

    from llmd.daemon.cli.main import main

    assert "smollm2-135m" in llmd_daemon.client().health()["model_ids"]
    r = CliRunner().invoke(main, ["chat", "--socket", llmd_daemon.path, "-m", "gemma3-270m", "-p", "Hi"])
    assert r.exit_code == 1, r.output
    assert "serves 'smollm2-135m', not 'gemma3-270m'" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(main, ["chat", "--socket", llmd_daemon.path, "-m", "smollm2-135m", "--kv-cache-dtype",
                                  "int8", "-p", "What is the capital of France?", "--max-tokens", "8",
                                  "--temperature", "0"])
    assert r.exit_code == 0, r.output
    assert "--kv-cache-dtype applies only when `llmd chat` starts one" in r.output and "Paris" in r.output, r.output
