"""Parallel sampling (OpenAI ``n``): one prompt, ``n`` sequences, prefilled once, then forked.

vLLM's ``vllm/v1/engine/parallel_sampling.py`` gives n-way fan-out one home; llmd keeps its own
better idea of *when* to fork and puts both here:

* **ids are data.** A parent request of ``n`` sequences gets child ids
  :func:`child_request_ids` (``{parent_id}-{i}``, names only), and :class:`ParallelRequests`
  records which children belong to which parent; nobody parses an id back. Each child
  :class:`~llmd.daemon.core.request.Request` carries its ``sibling_index`` (the OpenAI choice
  ``index``, copied into every :class:`~llmd.daemon.core.outputs.RequestOutput`), and its
  draws use generators keyed by (seed, sibling index, output position), so sequence 0 equals a
  lone request with the same seed.
* **fork policy** (the scheduler calls these): the first sequence is the *leader*; the others
  are its *followers* and wait, holding no blocks, until the leader has computed the prompt
  (:func:`attach_followers`). In the step that completes the prompt they fork the leader's
  block tables (ref counts; :meth:`KVCacheManager.fork`), start running and sample their
  first token from the leader's logits row (:func:`sampling_rows`, :func:`fork_followers`).
  The partly filled last block is copied on write when a sibling first appends to it (the
  KV manager queues the copy; the runner does it before the forward). A leader that ends
  before forking hands its followers to the next sibling (:func:`promote_heir`), which then
  prefills the prompt instead; a follower that ends first just leaves (:func:`drop_follower`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmd.daemon.core.errors import RequestError
from llmd.daemon.core.outputs import ScheduledRequest
from llmd.daemon.core.request import Request, RequestStatus


def child_request_ids(parent_id: str, n: int) -> list[str]:
    """The ids of a parent request's ``n`` sequences (``{parent_id}-{i}``; names only, never parsed)."""
    return [f"{parent_id}-{i}" for i in range(n)]


@dataclass
class ParentRequest:
    """One n-way request: its id, its children in index order, and those still live."""

    parent_id: str
    child_ids: tuple[str, ...]
    live: set[str] = field(default_factory=set)


class ParallelRequests:
    """Parent id ↔ child ids of the live requests added with a parent id (the engine's)."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, str] = {}

    def __contains__(self, parent_id: str) -> bool:
        return parent_id in self._parents

    def check_new(self, parent_id: str) -> None:
        """Raise :class:`RequestError` if ``parent_id`` names a live request already."""
        if parent_id in self._parents:
            raise RequestError(f"request id {parent_id!r} is already in use")

    def add(self, parent_id: str, child_ids: Sequence[str]) -> None:
        self.check_new(parent_id)
        self._parents[parent_id] = ParentRequest(parent_id, tuple(child_ids), set(child_ids))
        for c in child_ids:
            self._parent_of[c] = parent_id

    def members(self, request_id: str) -> list[str]:
        """A parent id's live children (index order); any other id: just that id."""
        p = self._parents.get(request_id)
        if p is None:
            return [request_id]
        return [c for c in p.child_ids if c in p.live]

    def parent_of(self, child_id: str) -> str | None:
        return self._parent_of.get(child_id)

    def finished(self, child_id: str) -> None:
        """A child ended; the parent is forgotten with its last child (its id is free again)."""
        parent_id = self._parent_of.pop(child_id, None)
        if parent_id is None:
            return
        p = self._parents[parent_id]
        p.live.discard(child_id)
        if not p.live:
            del self._parents[parent_id]


# ---- fork policy (called by the scheduler and the engine) ------------------------------
def attach_followers(leader: Request, followers: Iterable[Request]) -> None:
    """``followers`` wait for ``leader`` to compute the shared prompt, then fork it."""
    leader.followers = list(followers)


def drop_follower(req: Request, leaders: Iterable[Request]) -> None:
    """Remove a follower that never forked from its leader's list."""
    for leader in leaders:
        if req in leader.followers:
            leader.followers.remove(req)


def promote_heir(leader: Request) -> Request | None:
    """The leader ends before forking: its first follower leads the rest (and prefills the
    prompt itself). Returns that heir, or None when there were no followers."""
    if not leader.followers:
        return None
    heir, heir.followers = leader.followers[0], leader.followers[1:]
    leader.followers = []
    return heir


def fork_followers(leader: Request, kv) -> list[Request]:
    """The leader has computed the prompt: its waiting followers share its blocks (``kv.fork``:
    ref counts, copy-on-write later) and run from now on. Returns them."""
    followers, leader.followers = leader.followers, []
    for f in followers:
        kv.fork(leader.request_id, f.request_id)
        f.num_computed_tokens, f.num_cached_tokens = leader.num_computed_tokens, leader.num_cached_tokens
        f.status = RequestStatus.RUNNING
    return followers


def sampling_rows(scheduled: Sequence[ScheduledRequest],
                  requests: dict[str, Request]) -> tuple[list[Request], list[int]]:
    """The requests that sample this step, in batch order, and each one's logits row: a leader
    whose prompt completes now brings its followers, which draw from the leader's row."""
    sampling, rows = [], []
    for row, s in enumerate([s for s in scheduled if s.sample]):
        leader = requests[s.request_id]
        for r in (leader, *leader.followers):
            sampling.append(r)
            rows.append(row)
    return sampling, rows
