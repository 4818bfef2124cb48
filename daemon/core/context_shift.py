"""Context shift: a sequence that fills ``max_model_len`` drops its oldest tokens and goes on.

llama.cpp's ``--context-shift`` (``server.cpp``: ``n_discard = (n_past - n_keep) / 2``, then
``llama_kv_self_seq_rm`` + ``seq_add``): keep the first ``n_keep`` tokens, discard the oldest
half of the rest, and move the remaining cached keys back by the discarded count, re-rotating
their RoPE (rotations compose). On llmd's paged cache the cut falls on block boundaries:

* ``keep`` tokens (``--keep`` / a request's ``n_keep``; -1 = the whole prompt) round **up** to
  ``keep_blocks`` whole blocks, which are never touched; ``keep`` 0 still keeps the **first
  block** (the attention sink: Xiao et al. 2023, "Efficient Streaming Language Models with
  Attention Sinks" — a model puts much of its attention on the first tokens, and dropping them
  wrecks it: SmolLM2's teacher-forced NLL in a shifting 256-token context rose 26.6 % with
  nothing kept, −0.9 % with one block; llama.cpp keeps the BOS token for the same reason, Ollama
  keeps 4 tokens by default), unless the context is too small to discard a block after it;
* ``num_discard = max(1, ((computed − keep_blocks·block_size) // 2) // block_size)`` whole blocks
  after them are freed, so every shift returns blocks to the pool;
* the later blocks' keys are re-rotated by ``Δ = num_discard · block_size`` positions
  (:mod:`llmd.daemon.kv.shift` plans it, :func:`llmd.kernels.kv_shift.shift_keys` runs it in
  the next step, before the forward), and the request's tokens and ``num_computed_tokens``
  drop the same ``Δ`` (:meth:`Request.discard`): from then on it is the shorter context.

If a shift cannot be done in place (a sliding-window table lost its keep blocks to a prefix-cache
hit, or there is no room to copy shared blocks) the same tokens are discarded and the shorter
context is **recomputed** (the request re-enters the waiting queue's front, as a preempted one);
if there is nothing to discard (``keep`` covers the context) the request ends with
``finish_reason`` "length", as under "stop".

Semantics a client sees: output continues past ``max_model_len``; ``usage.prompt_tokens`` is the
prompt as sent, ``completion_tokens`` every generated token; what the model attends to after a
shift is the kept head plus the newest tokens, their keys carrying the K/V computed while the
discarded tokens were still in view (as in llama.cpp, not a fresh prefill of the shorter text).
"""

from __future__ import annotations

from llmd.daemon.core.outputs import BlockShift, ResidualShift
from llmd.daemon.core.request import Request
from llmd.daemon.kv.shift import can_shift_in_place, shift_blocks


def shifts(req: Request) -> bool:
    """Whether ``req`` shifts at ``max_model_len`` (its resolved ``context_overflow``)."""
    return req.sampling_params.context_overflow == "shift"


def keep_blocks(req: Request, block_size: int) -> int:
    """Whole blocks a shift of ``req`` keeps at the head: its ``n_keep`` tokens rounded up
    (-1: the prompt still in the context), at least one (the attention-sink block; :func:`plan`
    drops it only in a context too small to discard a block after it)."""
    keep = req.sampling_params.n_keep or 0
    tokens = req.num_prompt_tokens if keep == -1 else keep
    return max(1, -(-tokens // block_size))


def plan(req: Request, block_size: int) -> tuple[int, int] | None:
    """``(keep_blocks, num_discard)`` for shifting ``req`` now, or None when nothing can go
    (the kept head covers every computed full block)."""
    kb = keep_blocks(req, block_size)
    rest = req.num_computed_tokens - kb * block_size
    if rest < block_size and kb == 1 and not req.sampling_params.n_keep:
        kb, rest = 0, req.num_computed_tokens  # n_keep 0 in a context of two blocks: no sink block
    if rest < block_size:
        return None
    return kb, max(1, (rest // 2) // block_size)


def shift(req: Request, kv, pending: list[tuple[str, BlockShift | ResidualShift]]) -> str | None:
    """Shift ``req`` (RUNNING, its newest token not computed yet): returns "shifted" (the
    re-rotations appended to ``pending`` as ``(request_id, op)``: one :class:`BlockShift` per
    moved block and, with an int4 cache, one :class:`ResidualShift` per KV cache group for the
    open block's 16-bit K, which lives in the request's residual slot, not in its block),
    "recompute" (tokens discarded, blocks to be freed by the caller, who requeues it with
    ``num_computed_tokens`` 0) or None (nothing to discard: finish it with "length")."""
    p = plan(req, kv.block_size)
    if p is None:
        return None
    kb, nd = p
    bs = kv.block_size
    start, end = kb * bs, (kb + nd) * bs
    if not can_shift_in_place(kv, req.request_id, kb, nd):
        req.discard(start, end)
        return "recompute"
    delta = end - start
    ops = shift_blocks(kv, req.request_id, kb, nd)
    pending.extend((req.request_id, BlockShift(src, dst, g, delta)) for src, dst, g in ops)
    slots = kv.residual_slots(req.request_id)  # int4: the open block's K follows the sequence, not a block
    pending.extend((req.request_id, ResidualShift(slot, g, delta)) for g, slot in enumerate(slots or ()))
    req.discard(start, end)
    return "shifted"
