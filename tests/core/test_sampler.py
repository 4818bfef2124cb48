"""Sampler tests: greedy, filters, penalties, logprobs and batch-independent seeded draws (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from llmd.daemon.core.request import MIN_TEMPERATURE, Request, SamplingParams
from llmd.daemon.core.sampler import Sampler, SamplerOutput, row_seed

V = 64


def make_req(output=(), prompt=(1, 2, 3), rid="r", **kw) -> Request:
    kw.setdefault("seed", 1234)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(**kw),
                   output_token_ids=list(output))


def rand_logits(b=1, v=V, seed=0, scale=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


sampler = Sampler()


def test_greedy_is_argmax():
    logits = rand_logits(5, seed=1)
    reqs = [make_req(rid=str(i), temperature=0.0, seed=i) for i in range(5)]
    out = sampler(logits, reqs)
    assert isinstance(out, SamplerOutput)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5


def test_batched_greedy_rows_equal_row_by_row_sampling():
    """Plain greedy rows (no penalty, no logprobs) share one batched argmax; mixed with rows
    that take the per-row path (penalties, logprobs, temperature > 0), every token and logprob
    equals ``sample_row`` on that row alone; ties (and -inf rows) keep the first index."""
    from llmd.daemon.core.sampler import is_plain_greedy

    logits = rand_logits(7, seed=5)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1.0  # a tie: index 10 wins
    logits[4] = float("-inf")
    logits[4, 33] = logits[4, 40] = 0.0
    logits[0, 7] = logits[0, 9] = float("nan")  # NaN counts as the maximum, first one wins (torch and numpy)
    kinds = [dict(temperature=0.0), dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.3),
             dict(temperature=0.7, seed=3), dict(temperature=0.0), dict(temperature=0.0, logprobs=2),
             dict(temperature=0.0, presence_penalty=0.5)]
    reqs = [make_req(rid=str(i), output=(2, 10), **kw) for i, kw in enumerate(kinds)]
    assert [is_plain_greedy(r.sampling_params) for r in reqs] == [True, True, False, False, True, False, False]
    out = sampler(logits, reqs)
    expected = [Sampler.sample_row(logits[b].clone(), r) for b, r in enumerate(reqs)]
    assert out.sampled_token_ids == [t for t, _ in expected]
    assert out.logprobs == [lp for _, lp in expected]
    assert out.sampled_token_ids[:2] == [7, 10] and out.sampled_token_ids[4] == 33
    assert sampler(logits[:0], []).sampled_token_ids == []


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_top_k_1_is_greedy(temperature):
    logits = rand_logits(4, seed=2)
    for seed in range(10):
        reqs = [make_req(rid=str(i), temperature=temperature, top_k=1, seed=seed) for i in range(4)]
        assert sampler(logits, reqs).sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_same_seed_position_row_gives_same_token_in_any_batch():
    row = rand_logits(1, seed=3, scale=1.0)[0]
    for pos in range(20):
        req = make_req(output=[5] * pos, seed=99, temperature=0.9, top_p=0.95)
        alone = sampler(row[None].clone(), [req]).sampled_token_ids[0]
        others = rand_logits(4, seed=100 + pos)
        batch = torch.stack([others[0], others[1], row, others[2], others[3]])
        reqs = [make_req(output=[7] * (pos + k + 1), rid=f"o{k}", seed=k, temperature=1.3) for k in range(4)]
        reqs.insert(2, make_req(output=[5] * pos, seed=99, temperature=0.9, top_p=0.95))
        assert sampler(batch, reqs).sampled_token_ids[2] == alone
        # and a [B, V] tensor from a different device/dtype path gives the same
        assert sampler(batch.double(), reqs).sampled_token_ids[2] == alone


def test_row_seed_mixes_seed_and_position():
    seeds = {row_seed(s, i) for s in range(20) for i in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)


def test_different_seeds_differ():
    row = torch.zeros(1, V)  # uniform: 64 choices
    a = [sampler(row, [make_req(seed=1, output=[0] * i)]).sampled_token_ids[0] for i in range(50)]
    b = [sampler(row, [make_req(seed=2, output=[0] * i)]).sampled_token_ids[0] for i in range(50)]
    assert sum(x != y for x, y in zip(a, b)) > 30
    assert len(set(a)) > 20  # positions give different draws too


def test_empirical_distribution_matches_softmax():
    v, n = 8, 8000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5]])
    probs = logits.softmax(-1)[0]
    counts = torch.zeros(v)
    for i in range(n):
        req = make_req(seed=i, temperature=1.0, prompt=[0])
        counts[sampler(logits, [req]).sampled_token_ids[0]] += 1
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # chi-square, 7 dof, p = 0.001


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    draws = [sampler(logits, [make_req(seed=s, temperature=0.2)]).sampled_token_ids[0] for s in range(300)]
    hits = draws.count(0)
    assert hits > 285  # p(0) = e^5 / (e^5 + 3) ~ 0.98


def test_top_p_never_picks_excluded():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0, 1.0, -3.0]])
    probs = logits.softmax(-1)[0]
    order = probs.argsort(descending=True).tolist()
    top_p = 0.8
    allowed, mass = set(), 0.0
    for t in order:  # smallest prefix with mass >= top_p
        allowed.add(t)
        mass += float(probs[t])
        if mass >= top_p:
            break
    seen = {sampler(logits, [make_req(seed=s, top_p=top_p)]).sampled_token_ids[0] for s in range(1000)}
    assert seen <= allowed and seen == allowed
    # a tiny top_p keeps only the top token
    assert {sampler(logits, [make_req(seed=s, top_p=1e-6)]).sampled_token_ids[0] for s in range(50)} == {0}


def test_min_p_never_picks_excluded():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0, 1.0, -3.0]])
    probs = logits.softmax(-1)[0]
    min_p = 0.2
    allowed = {i for i in range(8) if probs[i] >= min_p * probs.max()}
    seen = {sampler(logits, [make_req(seed=s, min_p=min_p)]).sampled_token_ids[0] for s in range(1000)}
    assert seen <= allowed and seen == allowed


def test_top_k_keeps_k():
    logits = rand_logits(1, seed=4)
    allowed = set(logits[0].topk(5).indices.tolist())
    reqs = [make_req(seed=s, top_k=5, temperature=3.0) for s in range(500)]
    seen = {sampler(logits, [r]).sampled_token_ids[0] for r in reqs}
    assert seen == allowed


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
    # prompt [0, 1], output [2, 2, 3]: repetition over {0, 1, 2, 3}; freq/presence over {2: 2, 3: 1}
    rp, fp, pp = 2.0, 0.5, 0.25
    expected = torch.tensor([2.0 / rp, -1.0 * rp, 0.5 / rp - 2 * fp - pp, -0.5 * rp - fp - pp, 1.0, 3.0])
    req = make_req(prompt=[0, 1], output=[2, 2, 3], temperature=0.0,
                   repetition_penalty=rp, frequency_penalty=fp, presence_penalty=pp)
    from llmd.daemon.core.sampler import apply_penalties
    got = apply_penalties(logits[0].clone(), req.sampling_params, req.prompt_token_ids, req.output_token_ids)
    torch.testing.assert_close(got, expected)
    # the argmax follows the penalized logits: unpenalized 5 wins; now penalize 5 heavily
    assert sampler(logits, [req]).sampled_token_ids == [5]
    req2 = make_req(prompt=[5], output=[5, 5], temperature=0.0, repetition_penalty=1.0,
                    frequency_penalty=2.0, presence_penalty=0.0)
    assert sampler(logits, [req2]).sampled_token_ids == [0]  # 3 - 2*2 = -1 < 2
    req3 = make_req(prompt=[5], temperature=0.0, repetition_penalty=3.0)
    assert sampler(logits, [req3]).sampled_token_ids == [0]  # 3 / 3 = 1 < 2


def test_penalty_out_of_range_ids_fail_that_row_only():
    """A row whose own sampling raises fails alone (its reason in ``failed``); the others sample."""
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0]] * 2)
    out = sampler(logits, [make_req(prompt=[9], repetition_penalty=1.2), make_req(temperature=0.0)])
    assert list(out.failed) == [0] and "out of range" in out.failed[0]
    assert out.sampled_token_ids[1] == 2


def test_shape_errors():
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 4), [make_req()])
    with pytest.raises(ValueError):
        sampler(torch.zeros(4), [make_req()])


@pytest.mark.parametrize("temperature,top_p,rp", [(0.0, 1.0, 1.0), (0.7, 0.5, 1.3), (1.5, 1.0, 1.0)])
def test_logprobs_are_raw(temperature, top_p, rp):
    logits = rand_logits(3, seed=5)
    reqs = [make_req(rid=str(i), seed=i, temperature=temperature, top_p=top_p,
                     repetition_penalty=rp, logprobs=5, output=[1, 2]) for i in range(3)]
    reqs[1].sampling_params.logprobs = 0
    out = sampler(logits, reqs)
    raw = torch.log_softmax(logits, dim=-1)
    for b, (tok, lp) in enumerate(zip(out.sampled_token_ids, out.logprobs)):
        assert lp is not None and lp.token_id == tok
        assert abs(lp.logprob - float(raw[b, tok])) < 1e-5
        assert len(lp.top) == (0 if b == 1 else 5)
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-4
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        ref = raw[b].topk(len(lp.top))
        assert [t for t, _ in lp.top] == ref.indices.tolist()
        for (_, v), r in zip(lp.top, ref.values.tolist()):
            assert abs(v - r) < 1e-5
        if temperature == 0.0:
            assert tok == int(logits[b].argmax())


def test_neg_inf_logits_never_sampled():
    logits = torch.full((1, V), float("-inf"))
    logits[0, [3, 17]] = torch.tensor([0.0, 0.1])
    seen = {sampler(logits, [make_req(seed=s, logprobs=2)]).sampled_token_ids[0] for s in range(200)}
    assert seen == {3, 17}


def reference_mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Full-vocab masking (HF warpers, straightforward full sort) as the oracle."""
    x = logits.clone()
    if 0 < top_k < x.numel():
        x[x < x.topk(top_k).values[-1]] = float("-inf")
    if top_p < 1.0:
        p = x.softmax(-1)
        srt, order = p.sort(descending=True)
        before = srt.cumsum(-1) - srt
        drop = before >= top_p
        drop[0] = False
        x[order[drop]] = float("-inf")
    if min_p > 0.0:
        p = x.softmax(-1)
        x[p < min_p * p.max()] = float("-inf")
    return set(torch.nonzero(x > float("-inf")).squeeze(1).tolist())


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.9, 0.0), (0, 0.999, 0.0), (50, 0.7, 0.0), (0, 1.0, 0.05),
                                               (100, 0.95, 0.01), (7, 1.0, 0.0), (0, 0.3, 0.2)])
def test_filter_candidates_matches_full_mask(top_k, top_p, min_p):
    from llmd.daemon.core.sampler import filter_candidates
    for seed in range(3):
        logits = rand_logits(1, v=20000, seed=seed, scale=1.0)[0]  # flat: top-p needs > 1024 tokens
        got = filter_candidates(logits, top_k, top_p, min_p)
        assert got is not None and set(got.tolist()) == reference_mask(logits, top_k, top_p, min_p)
    assert filter_candidates(logits, 0, 1.0, 0.0) is None


def test_top_k_keeps_ties():
    from llmd.daemon.core.sampler import filter_candidates
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0])
    assert set(filter_candidates(logits, 2, 1.0, 0.0).tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("greedy", [True, False])
def test_non_finite_rows_fail_alone(greedy):
    """NaN, +inf and all -inf rows are reported in ``failed`` (plain greedy rows and sampled
    rows alike); a finite row in the same batch samples as it would alone, and a row with some
    -inf entries is usable, its -inf logprobs reported as -9999 (JSON has no -inf)."""
    kw = {"temperature": 0.0} if greedy else {"temperature": 0.8, "logprobs": 2}
    good = rand_logits(1, seed=3)[0]
    partial = good.clone()
    partial[: V - 1] = float("-inf")  # one finite logit left
    rows = [good, torch.full((V,), float("nan")), torch.full((V,), float("-inf")), good.clone(), partial]
    rows[3][7] = float("inf")
    reqs = [make_req(rid=f"r{i}", **kw) for i in range(len(rows))]
    out = sampler(torch.stack(rows), reqs)
    assert sorted(out.failed) == [1, 2, 3] and "non-finite" in out.failed[1]
    alone = sampler(good[None], [make_req(rid="r0", **kw)])
    assert out.sampled_token_ids[0] == alone.sampled_token_ids[0] and out.sampled_token_ids[4] == V - 1
    if not greedy:
        assert out.logprobs[4].logprob == 0.0 and out.logprobs[4].top[1][1] == -9999.0


def test_logit_bias_moves_greedy_and_sampling_only_for_its_row_and_keeps_raw_logprobs():
    """``logit_bias`` is added to its own row before greedy / sampling (a +100 token wins, a −100
    argmax loses); a neighbour without one keeps its token; logprobs stay the unbiased ones; an
    id outside the vocabulary fails that row alone."""
    logits = rand_logits(3, seed=11)
    top = int(logits[0].argmax())
    other = (top + 1) % V
    reqs = [make_req(temperature=0.0, logit_bias={other: 100.0}, logprobs=1),
            make_req(temperature=0.0),
            make_req(temperature=0.9, logit_bias={top: -100.0, other: 100.0})]
    plain = sampler(logits, [make_req(temperature=0.0)] * 3).sampled_token_ids
    out = sampler(logits, reqs)
    assert out.sampled_token_ids[0] == other and out.sampled_token_ids[2] == other and not out.failed
    assert out.sampled_token_ids[1] == plain[1]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert math.isclose(out.logprobs[0].logprob, float(raw[other]), abs_tol=1e-6)
    assert out.logprobs[0].top[0][0] == top  # the raw distribution's best, not the biased one
    bad = sampler(logits[:2], [make_req(temperature=0.0, logit_bias={V: 5.0}), make_req(temperature=0.0)])
    assert list(bad.failed) == [0] and "out of range" in bad.failed[0] and bad.sampled_token_ids[1] == plain[1]


def test_inverse_transform_draw_follows_probs_and_never_draws_zero_mass(monkeypatch):
    """The draw itself: a distribution with zero-mass entries (first, middle, last) over 20,000
    seeds: no zero-mass index ever, frequencies within chi-square p = 0.001 of ``probs``."""
    from llmd.daemon.core.sampler import inverse_transform_draw

    probs = torch.tensor([0.0, 0.1, 0.0, 0.4, 0.05, 0.45, 0.0])
    n = 20_000
    counts = torch.zeros(len(probs))
    g = torch.Generator()
    for i in range(n):
        g.manual_seed(i)
        counts[inverse_transform_draw(probs, g)] += 1
    assert counts[probs == 0].sum() == 0
    live = probs > 0
    expected = probs[live] * n
    assert float(((counts[live] - expected) ** 2 / expected).sum()) < 16.3  # 3 dof, p = 0.001
    # u · Σp rounded up to Σp (rand() stubbed to 1.0): the last index with mass, not the zero tail
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert inverse_transform_draw(torch.tensor([0.5, 0.5, 0.0]), g) == 1


def test_top_logprobs_list_ties_in_greedys_order():
    """Tied logits (a bfloat16 head rounds many to the same value): greedy takes the first index
    and ``top`` lists the tied ids lowest first, so the greedy token heads the list; ids tied at
    the cut are the lowest ones."""
    logits = torch.full((1, V), -5.0)
    logits[0, [40, 7, 23]] = 3.0  # three-way tie for the top
    logits[0, [50, 11]] = 1.0  # a tie at the cut of top 4
    out = sampler(logits, [make_req(temperature=0.0, logprobs=4)])
    (tok,), (lp,) = out.sampled_token_ids, out.logprobs
    assert tok == 7 and [t for t, _ in lp.top] == [7, 23, 40, 11]
    assert lp.top[0][0] == tok and lp.top[0][1] == lp.logprob


def test_tiny_temperature_is_raised_to_the_minimum():
    """A temperature far below 1 but above 0 (1e-38, valid in the API's [0, 2]) overflowed the
    logits to inf and drew an arbitrary token from NaN probabilities; it is raised to
    MIN_TEMPERATURE (vLLM's clamp), where the draw follows the distribution."""
    assert SamplingParams(temperature=1e-38).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.0).temperature == 0.0
    assert SamplingParams(temperature=0.5).temperature == 0.5
    logits = rand_logits(4, seed=5)
    logits[torch.arange(4), logits.argmax(dim=-1)] += 0.5  # at 0.01 the runner-up has < e^-50 of the top's mass
    out = sampler(logits, [make_req(rid=str(i), temperature=t, seed=i, logprobs=1)
                           for i, t in enumerate([1e-38, 1e-300, 5e-324, 1e-5])])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_min_tokens_masks_the_stop_tokens_until_reached():
    """vLLM's min_tokens: a row short of it cannot sample EOS or a ``stop_token_ids`` token, even
    where one is the argmax (greedy) or certain (sampled); once reached, nothing is masked."""
    logits = torch.full((3, V), -5.0)
    logits[:, 7] = 10.0  # EOS would win
    logits[:, 9] = 9.0  # then the stop token id
    logits[:, 11] = 1.0
    reqs = [make_req(rid="a", output=(1,), temperature=0.0, min_tokens=2, stop_token_ids=[9]),
            make_req(rid="b", output=(1,), temperature=0.7, min_tokens=3, stop_token_ids=[9]),
            make_req(rid="c", output=(1, 2), temperature=0.0, min_tokens=2, stop_token_ids=[9])]
    for r in reqs:
        r.eos_token_ids = frozenset({7})
    out = sampler(logits, reqs)
    assert out.sampled_token_ids[0] == 11 and out.sampled_token_ids[1] not in (7, 9)
    assert out.sampled_token_ids[2] == 7  # min_tokens reached: EOS is back
    reqs[0].eos_token_ids = frozenset()  # ignore_eos: only the stop ids are masked
    assert sampler(logits[:1], reqs[:1]).sampled_token_ids == [7]
