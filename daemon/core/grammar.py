"""Structured outputs: grammars compiled with xgrammar, one matcher per request, token masks.

The pieces (vLLM v1's ``vllm/v1/structured_output/backend_xgrammar.py`` has the same shape):

* :class:`GrammarSpec`: what a request asked for (a JSON schema, any JSON object, a regex, an
  EBNF grammar or a list of choices) as immutable, hashable data on its
  :class:`~llmd.daemon.core.request.SamplingParams`; ``param`` names the request field it came
  from (for a 400), and is not part of its identity.
* :class:`GrammarCompiler`: one per engine (so per tokenizer); builds xgrammar's
  ``TokenizerInfo`` on first use (~0.2 s for SmolLM2's 49,152 tokens) and compiles specs,
  keeping the last :data:`CACHE_SIZE` compiled grammars (an LRU keyed by the spec: the
  compiled grammar for a schema is built once per tokenizer). Thread-safe: the daemon compiles
  on its tokenizer pool, never on the event loop or the engine thread.
* :class:`GrammarState`: a request's ``xgrammar.GrammarMatcher``. It advances with every token
  appended to the request (:meth:`Request.append_output_token`), so it always describes the
  request's output tokens: preemption by recompute keeps those tokens (only their KV is
  recomputed), a prefix-cache hit changes no token, and each ``n`` > 1 sibling is built with
  its own fresh matcher (siblings fork before their first token).
* :func:`allowed_tokens`: the ``[k, V]`` bool masks of the constrained rows of a step (one
  bitmask fill per row; the sampler applies them to those rows only).

JSON is generated **without free whitespace** (``any_whitespace=False``: xgrammar's fixed
separators ``", "`` and ``": "``, nothing else between tokens), since a small model given the
choice loops on spaces and newlines; JSON schemas compile in xgrammar's strict mode (no
properties beyond those the schema lists), properties in the schema's order.

Raises: :class:`RequestError` naming ``param`` for a spec xgrammar cannot compile.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from llmd.daemon.core.errors import RequestError

KINDS = ("json", "json_object", "regex", "grammar", "choice")
CACHE_SIZE = 128  # compiled grammars kept per engine
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] [^ ]+:\d+: ")  # "[11:52:07] /project/cpp/x.cc:94: " on xgrammar errors


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint.

    Attributes:
        kind: one of :data:`KINDS`: ``json`` (``value`` = a JSON schema as canonical JSON
            text), ``json_object`` (any JSON object; ``value`` unused), ``regex`` (an
            ECMAScript-style regular expression), ``grammar`` (xgrammar / GBNF-style EBNF with
            a ``root`` rule), ``choice`` (``choices``: the output is exactly one of them).
        value: the schema text, regex or grammar.
        choices: the strings of ``choice``.
        param: the request field it came from (error messages only; not compared).
        parts: specs this one is built from, each with its own ``param`` (``tool_choice:
            "required"``: each tool's parameters schema); compiled only when this spec fails, to
            name the part at fault. Not compared.
    """

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()
    param: str = field(default="structured_outputs", compare=False)
    parts: tuple["GrammarSpec", ...] = field(default=(), compare=False)

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str) -> "GrammarSpec":
        """A JSON-schema spec; the schema is kept as compact JSON text in its own key order (the
        order of ``properties`` is the order they are generated in), so equal schemas share one
        compiled grammar."""
        return cls("json", json.dumps(schema, separators=(",", ":")), param=param)


def _message(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return _XGR_PREFIX.sub("", text[0] if text else type(e).__name__)


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer (xgrammar), with an LRU of the results.

    Args:
        hf_tokenizer: the model's HF tokenizer (``Tokenizer.hf``); xgrammar gets the
            ``transformers`` one (a ``FastTokenizer``'s :attr:`transformers`, loaded on first compile).
        vocab_size: the model's logits width V (may exceed the tokenizer's length).
        stop_token_ids: the model's end-of-sequence ids: the only tokens a finished grammar allows.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self.hf_tokenizer, self.vocab_size = hf_tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr  # 0.6 s to import: only once structured outputs are used

                hf = getattr(self.hf_tokenizer, "transformers", self.hf_tokenizer)  # FastTokenizer: load it now
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec):
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (from the LRU when seen before).

        Raises:
            RequestError: xgrammar refused it (an unsupported or malformed schema, regex or
                grammar); the message is xgrammar's, ``param`` is ``spec.param``, or the
                ``param`` of the first of ``spec.parts`` refused alone. Also when it compiles
                but allows no first token (an empty language: ``[^\\s\\S]``, ``root ::= root``),
                which would otherwise fail in the sampler (HTTP 500) at the first step.
        """
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiler = self._xgr_compiler()
        try:
            if spec.kind == "json":
                compiled = compiler.compile_json_schema(spec.value, any_whitespace=False)
            elif spec.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "grammar":
                compiled = compiler.compile_grammar(spec.value)
            elif spec.kind == "choice":
                rules = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices)
                compiled = compiler.compile_grammar(f"root ::= {rules}")
            else:
                raise RequestError(f"unknown structured output kind {spec.kind!r}", spec.param)
        except (RuntimeError, ValueError, TypeError) as e:
            if isinstance(e, RequestError):
                raise
            for part in spec.parts:  # a part xgrammar refuses alone is named by its own field
                self.compile(part)
            raise RequestError(f"{spec.param} is not a valid {_WHAT[spec.kind]}: {_message(e)}", spec.param) from None
        if not allowed_tokens([GrammarState(compiled)], self.vocab_size).any():  # one fill, ~0.05 ms
            raise RequestError(f"{spec.param} matches no text: no token can start it", spec.param)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


_WHAT = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
         "grammar": "EBNF grammar", "choice": "choice list"}


class GrammarState:
    """One request's position in its grammar (an ``xgrammar.GrammarMatcher``).

    Args:
        compiled: the ``CompiledGrammar`` from :meth:`GrammarCompiler.compile` (shared, read only).
    """

    def __init__(self, compiled):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (state unchanged) if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 ``[k, ceil(V / 32)]``,
        bit ``t % 32`` of word ``t // 32`` set iff token ``t`` is allowed)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()

    def only_stop_next(self) -> bool:
        """The grammar is complete and allows nothing but its stop tokens next: the reply is
        whole, one more token could only end it (the scheduler then finishes it with "stop" at
        ``max_tokens`` or the context instead of "length"). One bitmask fill (~0.05 ms), only
        once ``is_completed()`` (xgrammar: the root rule matched) holds."""
        if not self.matcher.is_completed():
            return False
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:self.vocab_size]
        return set(np.flatnonzero(bits).tolist()) <= set(self.matcher.stop_token_ids)


def allowed_tokens(states: Sequence[GrammarState], vocab: int) -> torch.Tensor:
    """Masks of the next tokens each state allows: ``[len(states), vocab]`` bool (CPU).

    One xgrammar bitmask fill per state (~0.03-0.06 ms for SmolLM2's vocabulary), then the
    bits unpacked little-endian (token ``t`` = bit ``t % 32`` of int32 word ``t // 32``)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(states), vocab)
    for i, s in enumerate(states):
        s.fill(bitmask, i)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.view(np.bool_))
