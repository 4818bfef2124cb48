"""Batched sampling on the logits' own device (the CUDA path of :class:`~llmd.daemon.core.sampler.Sampler`).

The same pipeline and semantics as the host sampler (its module docstring: raw logprobs,
``logit_bias``, repetition / frequency / presence penalties, greedy, temperature, top-k, top-p, min-p, the
exponential race ``argmax(probs / q)``), but as a few ``[B, V]`` tensor ops over every row at
once where the logits live; only the token ids, the failed-row flags and the logprobs a request
asked for are copied back (one small copy each).

Filters run in sorted order (one stable descending sort of the rows that need one, as vLLM's
``apply_top_k_top_p``): top-k keeps values >= the k-th largest (ties kept), top-p the smallest
prefix whose renormalised mass is >= top_p (mass of strictly more likely tokens < top_p, the
first always kept), min-p the survivors with p >= min_p · p_max; the surviving sets equal the
host sampler's :func:`~llmd.daemon.core.sampler.filter_candidates` (tested).

Noise: a counter-based generator. Row b's key is a hash of (seed, sibling index, output
position); the uniform for token v is ``u = (hash32(key, v) >> 8 + 0.5) / 2^24`` in (0, 1), and
``q = -log(u)`` is Exp(1). The hash is Chris Wellons' ``lowbias32`` integer mixer
(https://nullprogram.com/blog/2018/07/31/), computed in int64 with every product split so it
never exceeds 2^49 (exact on any device). So a token depends only on (seed, sibling, position,
the row's logits, its history), never on the batch — but the streams differ from the host
sampler's (which draws torch's CPU generator over the survivors only): a seeded request gives
different tokens on CPU and on CUDA, reproducibly on each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmd.daemon.core.outputs import TokenLogprobs
from llmd.daemon.core.request import Request
from llmd.daemon.core.sampler import MIN_LOGPROB, NON_FINITE, SamplerOutput, has_penalties

MASK32 = 0xFFFFFFFF
_vocab_hashes: dict[tuple[int, str], torch.Tensor] = {}


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x · c) mod 2^32`` for int64 ``x`` in [0, 2^32) and a 32-bit constant ``c``, with no
    intermediate above 2^49 (so no signed overflow on any backend)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` (Wellons): a bijective avalanche mixer on 32-bit values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: Sequence[int], siblings: Sequence[int], positions: Sequence[int],
             device: torch.device) -> torch.Tensor:
    """Per-row 32-bit keys ``[B]`` int64 from (seed (any int, taken mod 2^64), sibling, position)."""
    s = [x & (2**64 - 1) for x in seeds]
    cols = torch.tensor([[v & MASK32 for v in s], [v >> 32 for v in s], [v & MASK32 for v in siblings],
                         [v & MASK32 for v in positions]], dtype=torch.int64, device=device)
    h = mix32(cols[0] ^ 0x9E3779B9)
    for c in cols[1:]:
        h = mix32(h ^ mix32(c))
    return h


def uniform_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, V]`` float32 uniforms in (0, 1): ``u[b, v]`` a function of ``(keys[b], v)`` only."""
    cache_key = (vocab, str(keys.device))
    vh = _vocab_hashes.get(cache_key)
    if vh is None:
        vh = _vocab_hashes[cache_key] = mix32(torch.arange(vocab, dtype=torch.int64, device=keys.device) + 0x632BE5AB)
    k = keys[:, None]
    h = mix32(mix32(k ^ vh[None, :]) ^ mix32(k + 0x85EBCA6B))
    return ((h >> 8).to(torch.float32) + 0.5) * (2.0**-24)


def history_error(req: Request, vocab: int) -> str | None:
    """Why ``req``'s penalties cannot be applied (a history token id outside ``[0, V)``), or None."""
    ids = req.token_ids
    if has_penalties(req.sampling_params) and ids and (min(ids) < 0 or max(ids) >= vocab):
        return (f"sampling failed: ValueError: token id out of range for vocab size {vocab}: "
                f"min {min(ids)}, max {max(ids)}")
    return None


def bias_error(req: Request, vocab: int) -> str | None:
    """Why ``req``'s ``logit_bias`` cannot be applied (a token id outside ``[0, V)``), or None."""
    bias = req.sampling_params.logit_bias
    if bias and (min(bias) < 0 or max(bias) >= vocab):
        return f"sampling failed: ValueError: logit_bias token id out of range for vocab size {vocab}"
    return None


def add_logit_bias(logits: torch.Tensor, requests: Sequence[Request], skip=frozenset()) -> None:
    """Add each request's ``logit_bias`` to its row of ``logits [B, V]`` float32, in place (one
    scatter for all the biased rows; rows without a bias and rows in ``skip`` are untouched)."""
    rows, toks, vals = [], [], []
    for b, req in enumerate(requests):
        bias = req.sampling_params.logit_bias
        if bias and b not in skip:
            rows += [b] * len(bias)
            toks += list(bias)
            vals += list(bias.values())
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
                          torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


def apply_penalties_batched(logits: torch.Tensor, requests: Sequence[Request], skip=frozenset()) -> torch.Tensor:
    """Repetition (prompt + output tokens), frequency and presence (output tokens) penalties on
    ``logits [B, V]`` float32, in place, with the host formulas
    (:func:`~llmd.daemon.core.sampler.apply_penalties`); rows in ``skip`` are left alone. Every
    history token id of the other rows must be in ``[0, V)`` (see :func:`history_error`).
    """
    b_rep, t_rep, b_out, t_out = [], [], [], []
    rep, freq, pres = [], [], []
    for b, req in enumerate(requests):
        p = req.sampling_params
        rep.append(p.repetition_penalty)
        freq.append(p.frequency_penalty)
        pres.append(p.presence_penalty)
        if b in skip:
            continue
        if p.repetition_penalty != 1.0:
            seen = set(req.token_ids)
            b_rep += [b] * len(seen)
            t_rep += list(seen)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            out = req.token_ids[req.num_prompt_tokens:]
            b_out += [b] * len(out)
            t_out += list(out)
    dev = logits.device
    col = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev)[:, None]  # noqa: E731
    if t_rep:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(b_rep, device=dev), torch.tensor(t_rep, device=dev)] = True
        p = col(rep)
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits))
    if t_out:
        counts = torch.zeros_like(logits)
        counts.index_put_((torch.tensor(b_out, device=dev), torch.tensor(t_out, device=dev)),
                          torch.ones(len(t_out), device=dev), accumulate=True)
        logits.sub_(counts * col(freq) + (counts > 0).to(logits.dtype) * col(pres))
    return logits


def filter_mask_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor) -> torch.Tensor:
    """Which sorted positions survive top-k, then top-p, then min-p: ``[B, V]`` bool.

    Args:
        sorted_logits: ``[B, V]`` float32, each row sorted descending (stable), already divided
            by the temperature.
        top_k: ``[B]`` int64 (``<= 0`` or ``>= V`` disables); top_p ``[B]`` float32 (``>= 1``
            disables); min_p ``[B]`` float32 (``<= 0`` disables).
    """
    vocab = sorted_logits.shape[1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    keep = sorted_logits >= sorted_logits.gather(1, (k - 1)[:, None])
    neg = torch.tensor(float("-inf"), device=sorted_logits.device)
    if bool((top_p < 1.0).any()):
        probs = torch.where(keep, sorted_logits, neg).softmax(dim=-1)
        in_p = (probs.cumsum(dim=-1) - probs) < top_p[:, None]
        in_p[:, 0] = True
        keep &= in_p | (top_p >= 1.0)[:, None]
    if bool((min_p > 0.0).any()):
        probs = torch.where(keep, sorted_logits, neg).softmax(dim=-1)
        keep &= (probs >= min_p[:, None] * probs[:, :1]) | (min_p <= 0.0)[:, None]
    return keep


def sample_on_device(logits: torch.Tensor, requests: Sequence[Request],
                     masks: dict[int, torch.Tensor] | None = None) -> SamplerOutput:
    """Sample one token per row of ``logits [B, V]`` (any float dtype, any device) for ``requests``.

    Row b samples output position ``requests[b].num_output_tokens``. ``masks``: row → ``[V]``
    bool (CPU) of the tokens its grammar allows (structured outputs; those rows alone are masked
    to −inf after the penalties; logprobs stay raw). Rows whose logits are not usable (a NaN or
    +inf, or every entry -inf), rows whose penalties or ``logit_bias`` name an out-of-range token and constrained
    rows left with no allowed finite token fail alone (:attr:`SamplerOutput.failed`). Returns the
    same structure as the host sampler.
    """
    n = len(requests)
    raw = logits.detach().to(torch.float32)
    params = [r.sampling_params for r in requests]
    vocab = raw.shape[1]
    failed = {b: e for b, req in enumerate(requests)
              if (e := history_error(req, vocab) or bias_error(req, vocab)) is not None}
    work = raw.clone()
    if any(p.logit_bias for p in params):  # before the penalties, as on the host
        add_logit_bias(work, requests, skip=failed.keys())
    if any(has_penalties(p) for p in params):
        apply_penalties_batched(work, requests, skip=failed.keys())
    dev = work.device
    if masks:
        mask_rows = torch.tensor(list(masks), device=dev)
        allowed = torch.stack(list(masks.values())).to(dev)
        work[mask_rows] = work[mask_rows].masked_fill(~allowed, float("-inf"))
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    greedy = temp == 0.0
    tokens = work.argmax(dim=-1)
    if not all(p.temperature == 0.0 for p in params):
        scaled = work / torch.where(greedy, torch.ones_like(temp), temp)[:, None]
        keys = row_keys([p.seed or 0 for p in params], [r.sibling_index for r in requests],
                        [r.num_output_tokens for r in requests], dev)
        q = -torch.log(uniform_noise(keys, work.shape[1]))
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
            keep = filter_mask_sorted(
                sorted_logits, torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev))
            probs = torch.where(keep, sorted_logits, torch.tensor(float("-inf"), device=dev)).softmax(dim=-1)
            drawn = order.gather(1, (probs / q.gather(1, order)).argmax(dim=-1, keepdim=True))[:, 0]
        else:
            drawn = (scaled.softmax(dim=-1) / q).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)
    bad = ~torch.isfinite(raw.max(dim=-1).values)  # NaN propagates through max; all -inf has no finite peak
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    lp_rows = None
    if want:
        rows = torch.tensor(want, device=dev)
        lsm = torch.log_softmax(raw[rows], dim=-1)
        kmax = min(max(params[b].logprobs for b in want), lsm.shape[1])
        chosen = lsm.gather(1, tokens[rows][:, None])[:, 0]
        top_vals, top_ids = torch.topk(lsm, kmax) if kmax > 0 else (lsm[:, :0], lsm[:, :0].long())
        lp_rows = (chosen.cpu().tolist(), top_vals.cpu().tolist(), top_ids.cpu().tolist())
    token_list, bad_list = tokens.cpu().tolist(), bad.cpu().tolist()
    for b in range(n):
        if bad_list[b]:
            failed.setdefault(b, NON_FINITE)
    logprobs: list[TokenLogprobs | None] = [None] * n
    if lp_rows is not None:
        for i, b in enumerate(want):
            k = min(params[b].logprobs, len(lp_rows[1][i]))
            top = [(int(t), max(float(v), MIN_LOGPROB)) for t, v in zip(lp_rows[2][i][:k], lp_rows[1][i][:k])]
            logprobs[b] = TokenLogprobs(token_id=token_list[b], logprob=max(float(lp_rows[0][i]), MIN_LOGPROB), top=top)
    if masks:
        picked = work[mask_rows, tokens[mask_rows]].cpu().tolist()
        for (b, m), v in zip(masks.items(), picked):
            if not (bool(m[token_list[b]]) and v > float("-inf")):
                failed.setdefault(b, "sampling failed: ValueError: the output grammar allows no token here")
    for b in failed:
        token_list[b], logprobs[b] = 0, None
    return SamplerOutput(sampled_token_ids=token_list, logprobs=logprobs, failed=failed)
