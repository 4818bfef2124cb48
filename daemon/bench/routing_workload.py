"""The workload and the arithmetic of ``llmd bench routing`` (no processes, no HTTP: tested alone).

Multi-user chat where each user has their **own** long context: user ``u``'s system message is
a document of its own (the ~1,000-token public-domain text of ``kv_quality_text`` with its 30
sentences shuffled by seed ``u``, after a one-line case header), then ``turns`` questions, each
sent with the whole history (document, earlier questions, the model's own earlier answers).
No two users share more than the chat template's first tokens, so a replica serves a user's
turn from its prefix cache only if it served that user before; with one shared system prompt
instead, round robin hits on every replica too (the issue measured ~0.8 vs 0.93).

The hit rate of a phase is vLLM's prefix-cache hit rate summed over the replicas:
``Σ Δhits / Σ Δqueries`` (tokens; each replica's ``/v1/stats`` ``prefix_cache`` before and
after the phase).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT

QUESTIONS = [
    "Summarize this document in one sentence.",
    "Which sentence of the document do you find the most important, and why?",
    "List three words the document uses often.",
    "What would be a good title for the document?",
    "Is the document optimistic or pessimistic? Answer briefly.",
    "Rewrite the document's first sentence in plain modern English.",
    "Name one person or place the document mentions.",
    "What question does the document leave open?",
]


def document(user: int, words: int | None = None) -> str:
    """User ``user``'s own document: a case header and the fixed text's sentences in an order of
    its own (``random.Random(user)``, sentence ``user mod 30`` first, so no two of the first 30
    users start alike), ~1,000 SmolLM2 tokens; only its first ``words`` words when given (the
    whole text has 816)."""
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(QUALITY_TEXT.split()))
    first = sentences.pop(user % len(sentences))
    random.Random(user).shuffle(sentences)
    sentences.insert(0, first)
    text = " ".join(sentences)
    if words is not None:
        text = " ".join(text.split()[:words])
    return f"Case file {user:04d}. Read the document below and answer questions about it.\n\n" + text


def turn_messages(doc: str, history: list[dict], turn: int) -> list[dict]:
    """The chat messages of a user's turn ``turn`` (0-based): the document as the system
    message, the history (alternating user / assistant messages), the turn's question."""
    return [{"role": "system", "content": doc}, *history,
            {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}]


@dataclass
class ReplicaDelta:
    """One replica over one phase: prefix-cache queries and hits (tokens), prompt tokens the
    model computed, requests it finished."""

    queries: int
    hits: int
    computed: int
    requests: int


def replica_delta(before: dict, after: dict) -> ReplicaDelta:
    """The difference of two ``/v1/stats`` snapshots of one replica."""
    def finished(s: dict) -> int:
        return sum(s["counters"]["requests_finished"].values())

    return ReplicaDelta(after["prefix_cache"]["queries"] - before["prefix_cache"]["queries"],
                        after["prefix_cache"]["hits"] - before["prefix_cache"]["hits"],
                        after["counters"]["prompt_tokens"] - before["counters"]["prompt_tokens"],
                        finished(after) - finished(before))


@dataclass
class PhaseResult:
    """One routing policy over the whole workload."""

    policy: str
    replicas: list[ReplicaDelta]
    wall_s: float
    replies: list[list[str]] = field(default_factory=list)  # per user, per turn

    @property
    def queries(self) -> int:
        return sum(r.queries for r in self.replicas)

    @property
    def hits(self) -> int:
        return sum(r.hits for r in self.replicas)

    @property
    def hit_rate(self) -> float:
        """Σ hits / Σ queries over the replicas (0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0


def report(phases: list[PhaseResult], shape: str, target: float = 2.0) -> list[str]:
    """The table (one row per policy), the hit-rate ratio of the last policy over the first,
    and whether both phases got the same replies (greedy: they must, or the workloads differed)."""
    lines = [shape, f"{'policy':<13}{'requests per replica':>22}{'queried':>10}{'hits':>9}{'computed':>10}"
                    f"{'hit rate':>10}{'wall s':>8}"]
    for p in phases:
        per = "/".join(str(r.requests) for r in p.replicas)
        lines.append(f"{p.policy:<13}{per:>22}{p.queries:>10}{p.hits:>9}{sum(r.computed for r in p.replicas):>10}"
                     f"{p.hit_rate:>10.3f}{p.wall_s:>8.1f}")
    base, other = phases[0], phases[-1]
    ratio = other.hit_rate / base.hit_rate if base.hit_rate else float("inf")
    verdict = "met" if ratio >= target else "missed"
    lines.append(f"{other.policy} / {base.policy} hit rate: {ratio:.2f}x (target >= {target:g}x: {verdict})")
    same = all(p.replies == base.replies for p in phases)
    lines.append("replies identical across policies (greedy): " + ("yes" if same else "NO (the workloads differ)"))
    return lines
