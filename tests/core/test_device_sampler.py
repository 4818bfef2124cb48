"""The batched device sampler (the CUDA path), run here on CPU tensors: masks and penalties equal
the host sampler's, sample frequencies follow the filtered softmax, the counter-based noise is a
function of (seed, sibling, position) only."""

from __future__ import annotations

import math

import pytest
import torch

from llmd.daemon.core.device_sampler import (
    apply_penalties_batched,
    filter_mask_sorted,
    mix32,
    row_keys,
    sample_on_device,
    uniform_noise,
)
from llmd.daemon.core.request import Request, SamplingParams
from llmd.daemon.core.sampler import NON_FINITE, Sampler, apply_penalties, filter_candidates

V = 200


def req(rid="r", prompt=(1, 2, 3), output=(), sibling=0, **kw) -> Request:
    kw.setdefault("seed", 7)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(**kw),
                   output_token_ids=list(output), sibling_index=sibling)


def rand_logits(b, v=V, seed=0, scale=3.0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 in plain Python integers (the reference for :func:`mix32`)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_equals_reference_hash():
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789, 0xDEADBEEF]
    assert mix32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]


FILTERS = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (12, 0.8, 0.05), (1, 0.5, 0.0),
           (300, 0.95, 0.0), (0, 0.3, 0.2), (40, 1.0, 0.02), (3, 0.99, 0.5)]


def test_filter_masks_equal_host_path():
    """Per row, the surviving token ids equal :func:`filter_candidates`' exactly (with ties from
    rounded logits, so top-k ties at the threshold are exercised)."""
    logits = (rand_logits(len(FILTERS), seed=3) * 4).round() / 4
    temps = torch.linspace(0.5, 1.5, len(FILTERS))
    scaled = logits / temps[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    keep = filter_mask_sorted(sorted_logits, torch.tensor([f[0] for f in FILTERS]),
                              torch.tensor([f[1] for f in FILTERS]), torch.tensor([f[2] for f in FILTERS]))
    for b, (k, p, m) in enumerate(FILTERS):
        host = filter_candidates(logits[b].clone().div_(float(temps[b])), k, p, m)
        host_set = set(range(V)) if host is None else set(host.tolist())
        assert set(order[b][keep[b]].tolist()) == host_set, (k, p, m)


def test_penalties_equal_host_path():
    logits = rand_logits(3, seed=4)
    reqs = [req(prompt=(1, 5, 9), output=(5, 5, 7, 199), repetition_penalty=1.3),
            req(prompt=(2,), output=(3, 3, 3, 8), frequency_penalty=0.4, presence_penalty=0.25),
            req(prompt=(4, 4), output=(4, 6), repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.0)]
    got = apply_penalties_batched(logits.clone(), reqs)
    for b, r in enumerate(reqs):
        n = r.num_prompt_tokens
        want = apply_penalties(logits[b].clone(), r.sampling_params, r.token_ids[:n], r.token_ids[n:])
        assert torch.equal(got[b], want), b


def test_greedy_and_logprobs_equal_host_sampler():
    logits = rand_logits(4, seed=5)
    reqs = [req(str(i), temperature=0.0, logprobs=[None, 0, 3, 20][i], repetition_penalty=[1.0, 1.2, 1.0, 1.5][i],
                output=(10, 11)) for i in range(4)]
    dev, host = sample_on_device(logits, reqs), Sampler()(logits, reqs)
    assert dev.sampled_token_ids == host.sampled_token_ids and not dev.failed
    for a, b in zip(dev.logprobs, host.logprobs):
        if a is None:
            assert b is None
            continue
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-6)
        assert all(math.isclose(x, y, abs_tol=1e-6) for (_, x), (_, y) in zip(a.top, b.top))


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05)])
def test_sample_frequencies_follow_filtered_softmax(params):
    """20,000 rows of one logits row, each its own seed: token frequencies within 4.5 sigma of
    the (filtered, renormalised) softmax; filtered-out tokens never drawn."""
    n, v = 20_000, 12
    row = rand_logits(1, v=v, seed=6, scale=1.5)[0]
    scaled = row / params["temperature"]
    idx = filter_candidates(scaled.clone(), params.get("top_k", 0), params.get("top_p", 1.0), params.get("min_p", 0.0))
    p = torch.zeros(v)
    keep = torch.arange(v) if idx is None else idx
    p[keep] = scaled[keep].softmax(-1)
    out = sample_on_device(row.expand(n, v), [req(str(i), seed=i, **params) for i in range(n)])
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=v).float() / n
    sigma = (p * (1 - p) / n).sqrt()
    assert bool((freq[p == 0] == 0).all())
    assert bool(((freq - p).abs() <= 4.5 * sigma + 1e-4).all()), (freq, p)


def test_reproducible_and_batch_independent():
    logits = rand_logits(6, seed=8)
    reqs = [req(str(i), seed=100 + i % 2, temperature=1.0, top_p=0.95, output=[1] * i) for i in range(6)]
    a = sample_on_device(logits, reqs).sampled_token_ids
    assert a == sample_on_device(logits, reqs).sampled_token_ids
    assert a[3] == sample_on_device(logits[3:4], reqs[3:4]).sampled_token_ids[0]  # alone = in a batch


def test_noise_depends_on_seed_sibling_and_position():
    base = uniform_noise(row_keys([5], [0], [0], torch.device("cpu")), 4096)[0]
    assert 0.0 < float(base.min()) and float(base.max()) < 1.0 and abs(float(base.mean()) - 0.5) < 0.02
    for seeds, sibs, pos in (([5], [0], [1]), ([5], [1], [0]), ([6], [0], [0]), ([5 + 2**32], [0], [0])):
        other = uniform_noise(row_keys(seeds, sibs, pos, torch.device("cpu")), 4096)[0]
        assert float((other == base).float().mean()) < 0.01  # unrelated streams
        assert abs(float(torch.corrcoef(torch.stack([base, other]))[0, 1])) < 0.1
    again = uniform_noise(row_keys([5], [0], [0], torch.device("cpu")), 4096)[0]
    assert torch.equal(base, again)


def test_bad_rows_fail_alone():
    logits = rand_logits(3, seed=9)
    logits[1, 4] = float("nan")
    reqs = [req("a", temperature=0.9), req("b"), req("c", output=(V + 5,), repetition_penalty=1.1)]
    out = sample_on_device(logits, reqs)
    assert out.failed[1] == NON_FINITE and "out of range" in out.failed[2] and 0 not in out.failed
    assert 0 <= out.sampled_token_ids[0] < V


def test_logit_bias_equals_host_path_and_bad_ids_fail_alone():
    """``logit_bias`` on the device path: greedy and sampled rows pick what the host picks from the
    same biased logits (greedy exactly; a +100 bias decides a sampled row), unbiased rows are
    untouched, raw logprobs, and an id outside the vocabulary fails only its row."""
    logits = rand_logits(4, seed=9)
    top = int(logits[0].argmax())
    reqs = [req("a", temperature=0.0, logit_bias={3: 50.0, top: -30.0}, logprobs=2),
            req("b", temperature=0.0),
            req("c", temperature=0.8, logit_bias={17: 100.0}),
            req("d", temperature=0.0, logit_bias={V + 1: 1.0})]
    dev, host = sample_on_device(logits, reqs), Sampler()(logits, reqs)
    assert dev.sampled_token_ids[:3] == host.sampled_token_ids[:3] == [3, int(logits[1].argmax()), 17]
    assert list(dev.failed) == list(host.failed) == [3]
    assert dev.logprobs[0].top[0][0] == top and math.isclose(dev.logprobs[0].logprob, host.logprobs[0].logprob,
                                                             abs_tol=1e-6)
