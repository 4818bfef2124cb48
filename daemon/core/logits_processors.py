"""The sampler's logits processors: what changes a row's logits before the draw.

Repetition, frequency and presence penalties (:func:`apply_penalties`; HF
``RepetitionPenaltyLogitsProcessor``, the OpenAI formula as vLLM's ``apply_penalties``),
OpenAI's ``logit_bias`` (:func:`apply_logit_bias`), and the masks of the constrained rows
(:func:`constrained_masks`: structured-output grammars and ``min_tokens``).
:mod:`llmd.daemon.core.sampler` re-exports them, and its docstring gives where each runs in the
pipeline; the device path (:mod:`.device_sampler`) has its own batched penalties and takes the masks.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from llmd.daemon.core.request import Request, SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams,
                    prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> torch.Tensor:
    """Repetition, frequency and presence penalties on one row, in place.

    Args:
        logits: ``[V]`` float32 CPU tensor; modified in place and returned.
        params: the request's sampling parameters.
        prompt_token_ids / output_token_ids: the request's history (token ids < V).

    Raises:
        ValueError: a history token id is outside ``[0, V)``.
    """
    vocab = logits.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_token_ids) | set(output_token_ids)), dtype=torch.long)
        if seen.numel():
            _check_ids(seen, vocab)
            vals = logits[seen]
            p = params.repetition_penalty
            logits[seen] = torch.where(vals > 0, vals / p, vals * p)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and output_token_ids:
        counts = Counter(output_token_ids)
        ids = torch.tensor(list(counts.keys()), dtype=torch.long)
        _check_ids(ids, vocab)
        cnt = torch.tensor(list(counts.values()), dtype=torch.float32)
        logits[ids] -= cnt * params.frequency_penalty + params.presence_penalty
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """Add ``bias`` (token id → bias, OpenAI's ``logit_bias``) to one ``[V]`` float32 row, in place.

    Raises:
        ValueError: a token id is outside ``[0, V)``.
    """
    ids = torch.tensor(list(bias), dtype=torch.long)
    _check_ids(ids, logits.shape[0])
    logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)
    return logits


def has_penalties(params: SamplingParams) -> bool:
    """Whether :func:`apply_penalties` changes anything for ``params``."""
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _check_ids(ids: torch.Tensor, vocab: int) -> None:
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"token id out of range for vocab size {vocab}: "
                         f"min {int(ids.min())}, max {int(ids.max())}")


def constrained_masks(requests: Sequence[Request], vocab: int) -> dict[int, torch.Tensor]:
    """Row → ``[V]`` bool mask of the tokens it may sample, for the constrained rows only: those
    with a grammar (the tokens it allows) and those short of ``min_tokens`` (every token but
    their stop tokens: EOS unless ``ignore_eos``, and ``stop_token_ids``; vLLM's min-tokens
    logits processor; where a grammar allows nothing but a stop token, the grammar's mask stands,
    so a completed structured output ends). Empty, and xgrammar never imported, when no row is
    constrained."""
    rows = [b for b, req in enumerate(requests) if req.grammar is not None]
    out = {}
    if rows:
        from llmd.daemon.core.grammar import allowed_tokens

        masks = allowed_tokens([requests[b].grammar for b in rows], vocab)
        out = {b: masks[i] for i, b in enumerate(rows)}
    for b, req in enumerate(requests):
        sp = req.sampling_params
        if req.num_output_tokens < sp.min_tokens:
            stops = [t for t in (*req.eos_token_ids, *sp.stop_token_ids) if 0 <= t < vocab]
            if stops:
                mask = out[b].clone() if b in out else torch.ones(vocab, dtype=torch.bool)
                mask[stops] = False
                if b not in out or bool(mask.any()):  # a grammar that allows only its stop wins
                    out[b] = mask
    return out
