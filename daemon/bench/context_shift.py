"""``llmd bench context-shift``: what a context shift costs in quality, per KV dtype.

Teacher forcing of a long text (the kv-quality text, ~1,000 tokens on SmolLM2) through the
engine's own runner and paged cache, ``chunk`` tokens per step, in a context of
``max_model_len`` tokens that shifts (:mod:`llmd.daemon.core.context_shift`: keep ``keep``
tokens, drop the oldest half of the rest in whole blocks, re-rotate the kept keys) whenever the
next chunk would not fit — vs the same text with the whole of it in view. Reported per KV
dtype: mean NLL of every next token, ΔNLL vs the full-context run of the same dtype, top-1
agreement with it, and the ΔNLL of the quantized shifted run vs the 16-bit shifted run per
segment between shifts (segment k has seen k requantizing shifts: the drift). Also a greedy
continuation past the context with and without shifts, and the share of repeated 4-grams in
each (a fluency check: a broken re-rotation degenerates into loops or noise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmd.daemon.core import context_shift
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.outputs import BlockShift, ResidualShift
from llmd.daemon.core.request import Request, SamplingParams


@dataclass
class ShiftRun:
    """One teacher-forced pass: logits ``[N, vocab]`` of every position (the first token's row
    included), the shifts done and the first position after each one."""

    logits: torch.Tensor
    num_shifts: int = 0
    shift_starts: list[int] = field(default_factory=list)


def shifted_teacher_forced(engine: Engine, ids: list[int], chunk: int, keep: int) -> ShiftRun:
    """Teacher-force ``ids`` in ``engine``'s context (``engine.max_model_len`` tokens), shifting
    before a chunk that would overflow it. Raises RuntimeError when the pool cannot hold it."""
    kv, runner = engine.kv_manager, engine.runner
    req = Request("ctx-shift", [], SamplingParams(context_overflow="shift", n_keep=keep))
    rid, run, rows = req.request_id, ShiftRun(torch.empty(0)), []
    try:
        for pos in range(0, len(ids), chunk):
            part = ids[pos : pos + chunk]
            if req.num_computed_tokens + len(part) > engine.max_model_len:
                pending: list = []
                if context_shift.shift(req, kv, pending) != "shifted":
                    raise RuntimeError("the context cannot shift in place here (keep too large?)")
                runner.shift_blocks([op for _, op in pending if isinstance(op, BlockShift)],
                                    [op for _, op in pending if isinstance(op, ResidualShift)])
                run.num_shifts += 1
                run.shift_starts.append(pos)
            start = req.num_computed_tokens
            if kv.allocate_slots(rid, start + len(part), start) is None:
                raise RuntimeError(f"KV pool too small for {start + len(part)} tokens")
            req.token_ids += part
            rows.append(runner.prefill_logits(rid, part, start, kv.get_block_tables(rid), kv.residual_slots(rid)))
            req.num_computed_tokens += len(part)
    finally:
        kv.free(rid)
    run.logits = torch.cat(rows)
    return run


def _nll(logits: torch.Tensor, ids: list[int], lo: int = 1, hi: int | None = None) -> float:
    """Mean NLL of ``ids[lo:hi]`` under the rows before them."""
    hi = len(ids) if hi is None else hi
    lp = torch.log_softmax(logits[lo - 1 : hi - 1].float(), dim=-1)
    return -lp.gather(1, torch.tensor(ids[lo:hi])[:, None]).mean().item()


def repeated_4grams(tokens: list[int]) -> float:
    """Share of the 4-grams of ``tokens`` that occurred earlier in it (0 = none repeats)."""
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return 1 - len(set(grams)) / max(1, len(grams))


def greedy_continuation(model, tokenizer, prompt: list[int], new: int, **cfg) -> tuple[list[int], int]:
    """``new`` greedy tokens (EOS ignored) after ``prompt``; returns them and the shifts made."""
    engine = Engine(model, tokenizer, EngineConfig(**cfg))
    engine.add_request(list(prompt), SamplingParams(max_tokens=new, temperature=0, ignore_eos=True,
                                                    context_overflow="shift"), request_id="g")
    toks: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks += o.new_token_ids
    return toks, engine.scheduler.num_context_shifts


def context_shift_report(model, tokenizer, ids: list[int], max_model_len: int, keep: int, chunk: int,
                         kv_dtypes: tuple[str, ...], new_tokens: int, **engine_kw) -> list[str]:
    """The benchmark's lines (see the module docstring). ``engine_kw``: EngineConfig fields."""
    lines = [f"text {len(ids)} tokens, context {max_model_len}, keep {keep}, chunk {chunk}, block "
             f"{engine_kw.get('block_size', 16)}",
             f"{'kv dtype':<16}{'NLL full':>10}{'NLL shift':>11}{'ΔNLL':>9}{'top-1':>8}{'shifts':>8}"]
    shifted16: ShiftRun | None = None
    drift_rows = []
    for dt in kv_dtypes:
        full_engine = Engine(model, tokenizer, EngineConfig(kv_cache_dtype=dt, **engine_kw))
        full = full_engine.teacher_forced_logits(ids, chunk)
        del full_engine
        engine = Engine(model, tokenizer, EngineConfig(kv_cache_dtype=dt, max_model_len=max_model_len, **engine_kw))
        run = shifted_teacher_forced(engine, ids, chunk, keep)
        nf, ns = _nll(full, ids), _nll(run.logits, ids)
        top1 = (full[:-1].argmax(-1) == run.logits[:-1].argmax(-1)).float().mean().item()
        label = dt + ("" if engine.config.kv_rotation in (None, "none") else f"+{engine.config.kv_rotation}")
        lines.append(f"{label:<16}{nf:>10.4f}{ns:>11.4f}{100 * (ns - nf) / nf:>8.2f}%{100 * top1:>7.1f}%"
                     f"{run.num_shifts:>8}")
        if shifted16 is None:
            shifted16 = run
        else:
            bounds = [1, *run.shift_starts, len(ids)]
            drift_rows.append((label, [100 * (_nll(run.logits, ids, a, b) - _nll(shifted16.logits, ids, a, b))
                                       / _nll(shifted16.logits, ids, a, b) for a, b in zip(bounds, bounds[1:])]))
    if drift_rows:
        lines.append(f"drift: ΔNLL vs the {kv_dtypes[0]} shifted run per segment (segment k after k shifts)")
        lines += [f"  {label:<14}" + " ".join(f"{d:+6.2f}%" for d in ds) for label, ds in drift_rows]
    prompt = ids[:max_model_len // 2]
    shifted, n_shift = greedy_continuation(model, tokenizer, prompt, new_tokens, max_model_len=max_model_len,
                                           keep=keep, **engine_kw)
    whole, _ = greedy_continuation(model, tokenizer, prompt, new_tokens, **engine_kw)
    lines.append(f"greedy {new_tokens} tokens after {len(prompt)}: repeated 4-grams "
                 f"{100 * repeated_4grams(shifted):.1f} % "
                 f"with {n_shift} shifts (context {max_model_len}) vs {100 * repeated_4grams(whole):.1f} % unshifted; "
                 f"the two agree on the first "
                 f"{next((i for i, (a, b) in enumerate(zip(shifted, whole)) if a != b), len(whole))} tokens")
    return lines
