"""Token sampling: penalties, temperature, top-k / top-p / min-p, seeded per-request draws.

Pipeline per row (order as in vLLM's ``vllm/v1/sample/sampler.py`` and HF transformers'
``generation/logits_process.py``):

1. logprobs of the *raw* distribution, ``log_softmax(logits)`` (vLLM's default
   ``logprobs_mode="raw_logprobs"``);
2. repetition penalty over prompt + output tokens (HF ``RepetitionPenaltyLogitsProcessor``,
   CTRL, Keskar et al. 2019): positive logits divided by the penalty, negative multiplied;
3. frequency and presence penalties over output tokens only (OpenAI formula, vLLM
   ``apply_penalties``): ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``;
4. ``temperature == 0`` -> argmax of the penalized logits (first index on ties; rows that are
   greedy with no penalty and no logprobs share one batched argmax, the same tokens);
   otherwise divide by the temperature, then top-k (HF ``TopKLogitsWarper``), top-p
   (HF ``TopPLogitsWarper``; keeps the smallest set whose mass >= top_p, the top token always
   kept), min-p (HF ``MinPLogitsWarper``: drop p < min_p * p_max), softmax over the
   surviving tokens, and draw by inverse transform sampling: one uniform from the row's
   generator against the cumulative probabilities in token order (:func:`inverse_transform_draw`;
   until 2026-12-03 the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``, vLLM's
   ``random_sample``, whose 49,152 draws per row cost 1.7 ms on this CPU against 0.13 ms).

``logit_bias`` (OpenAI's {token id: bias}): a row whose request carries one has the biases
added to its logits between steps 1 and 2 (vLLM v1 applies it before the penalties too), so
greedy and sampling see them and logprobs do not; rows without one are not touched, and a
plain greedy row with a bias leaves the batched argmax (:func:`is_plain_greedy`).

Structured outputs: a row whose request has a grammar (:attr:`Request.grammar`) has every
token its grammar does not allow set to −inf after the penalties (between steps 3 and 4), before
greedy or temperature sampling; only those rows are masked (:func:`~llmd.daemon.core.grammar.allowed_tokens`),
the others' logits are never touched. Logprobs stay those of the raw, unmasked distribution.
A constrained row whose grammar allows no finite-logit token fails alone.

Rows that cannot be sampled fail alone (:attr:`SamplerOutput.failed`, row → one-line
reason), never the batch: a row whose logits are not usable (any NaN or +inf, or every
entry −inf: e.g. float16 overflow in the model) is detected by one vectorized check per step
(the row's maximum is finite; NaN propagates through ``max``, and a plain greedy row's
maximum is the value at its argmax, so those rows cost a gather), and a row whose own
sampling raises (a penalty over an out-of-range token id, ...) is reported with the error.
Logprobs are clamped below at −9999 (vLLM's serving layer does the same), so a −inf never
reaches JSON, which has no spelling for it.

Reproducibility: the draw for output position ``i`` of a request uses a fresh CPU
``torch.Generator`` seeded with ``blake2b(seed, i)``, and every row is processed alone on
CPU in float32, so a request's token depends only on (seed, i, its logits row, its own
token history for penalties), never on which other requests share the batch.

Logits on a GPU are sampled there instead, all rows at once (:mod:`.device_sampler`: the same
semantics, a counter-based noise stream, so seeded tokens differ between CPU and CUDA); CPU
logits always take the host path below (its streams changed once, on 2026-12-03, with the draw
above: seeded CPU outputs of earlier versions differ).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from llmd.daemon.core.logits_processors import apply_logit_bias, apply_penalties, constrained_masks, has_penalties
from llmd.daemon.core.outputs import TokenLogprobs
from llmd.daemon.core.request import Request, SamplingParams

#: logprobs below this are reported as this (vLLM's ``max(logprob, -9999.0)``): JSON has no -inf
MIN_LOGPROB = -9999.0
NON_FINITE = "the model produced non-finite logits (NaN or inf; e.g. float16 overflow)"

__all__ = ["Sampler", "SamplerOutput", "TokenLogprobs", "apply_logit_bias", "apply_penalties", "constrained_masks",
           "filter_candidates", "inverse_transform_draw", "is_plain_greedy", "row_seed"]


@dataclass
class SamplerOutput:
    """Result of one sampler call; index b belongs to ``requests[b]``.

    Attributes:
        sampled_token_ids: one token id per row (0, meaningless, for a failed row).
        logprobs: per row, :class:`TokenLogprobs` or ``None`` when the request asked for none.
        failed: row → one-line reason, for rows that could not be sampled (non-finite logits,
            an exception in that row's sampling); their requests must fail, the rest go on.
    """

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    failed: dict[int, str] = field(default_factory=dict)


def row_seed(seed: int, position: int, sibling: int = 0) -> int:
    """Mix a request seed, a parallel-sampling sibling index and an output position into a
    63-bit generator seed.

    ``blake2b(f"{seed}:{position}")`` (``f"{seed}:{sibling}:{position}"`` for siblings > 0)
    truncated to 8 bytes, top bit cleared, so neighbouring positions, siblings and seeds give
    unrelated streams. Deterministic across processes and runs.
    """
    key = f"{seed}:{position}" if sibling == 0 else f"{seed}:{sibling}:{position}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def inverse_transform_draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One draw from the categorical ``probs`` (``[N]`` float32, sums to ~1) by inverse transform
    sampling: one float64 uniform ``u`` from ``gen``, the first index whose cumulative
    probability (float64, in index order) exceeds ``u · Σp``. Exact for the distribution
    (zero-probability entries are never drawn) and one random number per row: torch's CPU
    ``exponential_`` over a 49,152-token vocabulary (the exponential race this replaced) took
    1.7 ms per row here, this 0.13 ms."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    j = int(torch.searchsorted(cdf, u, right=True))
    if j >= cdf.shape[0]:  # u·Σp rounded up to Σp: the last token with mass
        j = int(torch.nonzero(probs).max())
    return j


def filter_candidates(logits: torch.Tensor, top_k: int, top_p: float,
                      min_p: float) -> torch.Tensor | None:
    """Token ids that survive top-k, then top-p, then min-p; ``None`` when no filter is on.

    Args:
        logits: ``[V]`` float32, already divided by the temperature (not modified).
        top_k: keep tokens whose logit >= the k-th largest (ties at the threshold are kept,
            as in HF ``TopKLogitsWarper`` / vLLM ``apply_top_k_only``); ``<= 0`` or ``>= V``
            disables.
        top_p: keep the smallest prefix of the descending-probability order (over the
            top-k survivors, renormalized) whose mass is >= top_p; the most likely token is
            always kept (HF ``TopPLogitsWarper``); ``>= 1`` disables.
        min_p: drop tokens with ``p < min_p * max(p)`` over the survivors, renormalized
            (HF ``MinPLogitsWarper``); ``<= 0`` disables.

    Returns:
        ``[N]`` int64 token ids (N >= 1 if any logit is finite), or ``None`` = all of V.
        Only the survivors are ranked: top-p takes a growing ``topk`` instead of a full
        sort of V (same order, same cumulative sums).
    """
    vocab = logits.shape[0]
    idx: torch.Tensor | None = None
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        idx = torch.nonzero(logits >= kth).squeeze(1)
    if top_p < 1.0:
        if idx is None:
            probs = logits.softmax(dim=-1)
            k = min(vocab, 1024)
            while True:
                p_sorted, order = torch.topk(probs, k)
                if k == vocab or float(p_sorted.sum()) >= top_p:
                    break
                k = min(vocab, 4 * k)
            cand = order
        else:
            vals, order = torch.sort(logits[idx], descending=True, stable=True)
            p_sorted, cand = vals.softmax(dim=-1), idx[order]
        mass_before = p_sorted.cumsum(dim=-1) - p_sorted  # mass of strictly more likely tokens
        keep = mass_before < top_p
        keep[0] = True
        idx = cand[keep]
    if min_p > 0.0:
        probs = (logits if idx is None else logits[idx]).softmax(dim=-1)
        keep = probs >= min_p * probs.max()
        idx = torch.nonzero(keep).squeeze(1) if idx is None else idx[keep]
    return idx


def top_logprobs(raw_logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` largest of ``raw_logprobs [V]`` as (token id, value), largest first and, among
    equal values, lowest id first: the order greedy's argmax takes (first index on ties), so a
    greedy token that ties with others is listed first. ``torch.topk`` alone leaves the order of
    ties (and which tied ids make the cut) unspecified: SmolLM2's bfloat16 head gave ``The`` and
    ``L`` the same logit, greedy took one and ``top_logprobs`` listed the other first."""
    vals, idx = torch.topk(raw_logprobs, k)
    if bool(torch.isnan(vals).any()):  # no order to speak of
        return list(zip(idx.tolist(), vals.tolist()))
    cand = torch.nonzero(raw_logprobs >= vals[-1]).flatten()  # every id tied at the cut, ascending
    order = torch.sort(raw_logprobs[cand], descending=True, stable=True).indices[:k]
    sel = cand[order]
    return list(zip(sel.tolist(), raw_logprobs[sel].tolist()))


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with no penalties, no ``logit_bias`` and no logprobs: the token is ``argmax(raw
    logits)``, so such rows share one batched argmax (no per-row clone, penalty pass or generator)."""
    return (params.temperature == 0.0 and params.logprobs is None and not has_penalties(params)
            and not params.logit_bias)


class Sampler:
    """Samples one token per row of a logits batch.

    Call: ``sampler(logits, requests) -> SamplerOutput``.

    Args (of ``__call__``):
        logits: ``[B, V]`` float tensor, the last position's logits of each running request:
            on CPU sampled row by row in float32 here; on any other device batched there
            (:func:`~llmd.daemon.core.device_sampler.sample_on_device`).
        requests: ``B`` requests; row b samples output position
            ``len(requests[b].output_token_ids)`` of ``requests[b]``.

    Raises:
        ValueError: ``logits`` is not 2-D or ``B != len(requests)`` (a row's own failure is
            reported in :attr:`SamplerOutput.failed` instead).
    """

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} requests")
        if logits.device.type != "cpu":  # batched where the logits live; only ids and asked-for logprobs come back
            from llmd.daemon.core.device_sampler import sample_on_device

            return sample_on_device(logits, requests, constrained_masks(requests, logits.shape[1]))
        cpu = logits.detach().to(device="cpu", dtype=torch.float32)
        n = len(requests)
        tokens: list[int] = [0] * n
        logprobs: list[TokenLogprobs | None] = [None] * n
        masks = constrained_masks(requests, cpu.shape[1])
        plain = [b for b, req in enumerate(requests) if is_plain_greedy(req.sampling_params) and b not in masks]
        plain_set = set(plain)
        rest = [b for b in range(n) if b not in plain_set] if len(plain) < n else []
        peaks = np.empty(n, dtype=np.float32)  # each row's maximum: finite iff the row is usable
        if plain:  # one argmax for all of them: exact, first index on ties (NaN first), as row by row;
            # numpy's argmax is vectorized (4 us for 49k floats here, torch's CPU argmax 43 us)
            rows = (cpu if len(plain) == n else cpu[plain]).contiguous().numpy()
            argmax = rows.argmax(axis=-1)
            peaks[plain] = rows[np.arange(len(plain)), argmax]  # NaN first, so a NaN row's peak is NaN
            for b, tok in zip(plain, argmax.tolist()):
                tokens[b] = tok
        if rest:
            peaks[rest] = (cpu if len(rest) == n else cpu[rest]).contiguous().numpy().max(axis=-1)
        failed = {int(b): NON_FINITE for b in np.flatnonzero(~np.isfinite(peaks))}
        for b in rest:
            if b in failed:
                continue
            try:  # clone(): a fresh contiguous buffer per row, so no kernel sees batch layout.
                tokens[b], logprobs[b] = self.sample_row(cpu[b].clone(), requests[b], masks.get(b))
            except Exception as e:  # this row's request fails; the batch goes on
                failed[b] = f"sampling failed: {type(e).__name__}: {e}"
        return SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs, failed=failed)

    @staticmethod
    def sample_row(row: torch.Tensor, req: Request,
                   allowed: torch.Tensor | None = None) -> tuple[int, TokenLogprobs | None]:
        """Sample one token for ``req`` from ``row`` (``[V]`` float32 CPU; consumed).

        ``allowed``: ``[V]`` bool, the tokens its grammar allows (structured outputs), or None.
        Returns ``(token_id, TokenLogprobs | None)``; see the module docstring for the order.
        A ``seed`` of ``None`` (never the case after ``SamplingParams.__post_init__``) acts as 0.

        Raises:
            ValueError: the grammar allows no token with a finite logit, or a ``logit_bias`` id
                is outside the vocabulary.
        """
        params = req.sampling_params
        raw_logprobs = torch.log_softmax(row, dim=-1) if params.logprobs is not None else None

        if params.logit_bias:
            apply_logit_bias(row, params.logit_bias)
        n, history = req.num_prompt_tokens, req.token_ids
        logits = apply_penalties(row, params, history[:n], history[n:]) if has_penalties(params) else row
        if allowed is not None:
            logits.masked_fill_(~allowed, float("-inf"))
        if params.temperature == 0.0:
            token = int(torch.argmax(logits))
        else:
            logits.div_(params.temperature)
            idx = filter_candidates(logits, params.top_k, params.top_p, params.min_p)
            probs = (logits if idx is None else logits[idx]).softmax(dim=-1)
            seed = params.seed if params.seed is not None else 0
            gen = torch.Generator(device="cpu")
            gen.manual_seed(row_seed(seed, req.num_output_tokens, req.sibling_index))
            j = inverse_transform_draw(probs, gen)
            token = j if idx is None else int(idx[j])
        if allowed is not None and not (bool(allowed[token]) and logits[token] > float("-inf")):
            raise ValueError("the output grammar allows no token here")

        if raw_logprobs is None:
            return token, None
        k = min(params.logprobs, raw_logprobs.shape[0])
        top: list[tuple[int, float]] = []
        if k > 0:
            top = [(int(i), max(float(v), MIN_LOGPROB)) for i, v in top_logprobs(raw_logprobs, k)]
        return token, TokenLogprobs(token_id=token, logprob=max(float(raw_logprobs[token]), MIN_LOGPROB), top=top)
