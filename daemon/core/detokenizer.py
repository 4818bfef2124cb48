"""UTF-8-safe incremental detokenization with stop strings.

Invariant (DESIGN.md): the deltas returned by :meth:`IncrementalDetokenizer.update` and
:meth:`IncrementalDetokenizer.finish`, joined, equal the non-streamed text, and no delta
ever contains half a UTF-8 character or a prefix of a stop string that later completes.

Two stages:

1. Tokens -> text with a sliding ``prefix_offset`` / ``read_offset`` window, as vLLM's
   ``detokenize_incrementally`` (``vllm/transformers_utils/detokenizer_utils.py``): decode
   ``tokens[prefix_offset:]`` and ``tokens[prefix_offset:read_offset]`` and emit the
   difference, unless the window ends in ``"\\ufffd"`` (an incomplete UTF-8 sequence of a
   byte-level token) or did not grow; then hold it until more tokens arrive. A few prompt
   tokens seed the window (vLLM's ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``) so that
   tokenizers whose decoder strips a leading space (SentencePiece) keep it mid-sentence.
2. Stop strings (OpenAI semantics, vLLM ``check_stop_strings``): the text is cut right
   before the earliest occurrence of any stop string, which is not included; the longest
   suffix of the pending text that is a prefix of a stop string is held back until it
   either completes (stop) or stops matching (released).

For byte-level BPE tokenizers (GPT-2 / SmolLM2 family) the joined output equals
``tokenizer.decode(output_ids, skip_special_tokens=...)`` cut at the first stop string.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["IncrementalDetokenizer", "INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET"]

#: prompt tokens that seed the decode window (vLLM uses 5).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT = "\ufffd"


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops.

    ``all_special_ids`` plus every added token flagged ``special`` (HF fast tokenizers skip
    those too, e.g. SmolLM2's ``<repo_name>``).
    """
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns a stream of output token ids into safe text deltas for one request.

    Args:
        tokenizer: a Hugging Face tokenizer (``convert_ids_to_tokens``,
            ``convert_tokens_to_string``, ``all_special_ids``, optionally
            ``added_tokens_decoder``).
        prompt_token_ids: the prompt; only its last few tokens are used, as decode context.
        stop: stop strings (non-empty ``str``); ``[]`` for none.
        skip_special_tokens: drop special tokens from the text (OpenAI / vLLM default).
        min_tokens: no stop string may end in the text of the first ``min_tokens`` tokens; one
            that starts there and ends after them matches (vLLM's ``stop_check_offset``).

    Attributes:
        output_text: all text released so far (``str``; the concatenation of every delta).
        stop_matched: the stop string that ended the text, or ``None``. Once set, every
            later ``update`` / ``finish`` returns ``""``.

    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.tokenizer = tokenizer
        self.stop: list[str] = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self._special = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self.output_text = ""
        self.stop_matched: str | None = None
        self._min_tokens, self._num_tokens = min_tokens, 0  # output tokens seen, special ones included
        self._stop_from = 0  # chars of _pending before the min_tokens offset: a stop must end past them
        self._pending = ""  # decoded, complete text not yet released (possible stop prefix)
        self._tokens: list[str] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._seed_window(prompt_token_ids)

    def _seed_window(self, prompt_token_ids: Sequence[int]) -> None:
        """Put the prompt's last tokens in front of the window as decode context (vLLM)."""
        tail = [t for t in list(prompt_token_ids)[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2):]
                if t not in self._special]
        tokens = self.tokenizer.convert_ids_to_tokens(tail) if tail else []
        # A prompt ending mid-character would swallow the output's first bytes into a
        # prefix_text that ends in U+FFFD; then decode the output without context.
        if tokens and self._to_string(tokens).endswith(_REPLACEMENT):
            tokens = []
        self._tokens = list(tokens)
        self._prefix_offset = max(len(tokens) - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self._read_offset = len(tokens)

    @property
    def finished(self) -> bool:
        """True once a stop string matched."""
        return self.stop_matched is not None

    def _to_string(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def _decode_step(self, force: bool) -> str:
        """Stage 1: newly complete text from the token window (vLLM algorithm).

        With ``force`` the window's tail is released even if it ends in U+FFFD.
        """
        prefix_text = self._to_string(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._to_string(self._tokens[self._prefix_offset:])
        if not force and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""
        delta = new_text[len(prefix_text):]  # by length, as vLLM does
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return delta

    def _release(self, delta: str, final: bool, stops: bool = True) -> str:
        """Stage 2: append ``delta`` to the pending text, apply stop strings, return what is safe.
        Without ``stops`` (the first ``min_tokens`` tokens) nothing is matched, but a possible
        stop prefix is still held back: a stop string that starts there and ends after them
        matches (vLLM's ``check_stop_strings`` from ``stop_check_offset``)."""
        self._pending += delta
        pending = self._pending
        if not pending:
            return ""
        cut = -1
        for s in self.stop if stops else ():  # earliest occurrence wins; list order breaks ties
            i = pending.find(s, max(0, self._stop_from - len(s) + 1))
            if i != -1 and (cut == -1 or i < cut):
                cut, self.stop_matched = i, s
        if cut != -1:
            out = pending[:cut]
            self._pending = ""
        else:
            hold = 0 if final else self._held_suffix_len(pending)
            out = pending[:len(pending) - hold]
            self._pending = pending[len(pending) - hold:]
        self._stop_from = len(self._pending) if not stops else max(0, self._stop_from - len(out))
        self.output_text += out
        return out

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Feed newly generated token ids; return the newly safe text delta (maybe ``""``).

        Special tokens are skipped when ``skip_special_tokens``. After a stop string
        matched, returns ``""`` and ignores the tokens.
        """
        if self.stop_matched is not None:
            return ""
        self._num_tokens += len(new_token_ids)
        ids = [t for t in new_token_ids if t not in self._special]
        if not ids:
            return ""
        self._tokens.extend(self.tokenizer.convert_ids_to_tokens(ids))
        # before min_tokens: no stop string is matched (one may start there and end after)
        return self._release(self._decode_step(force=False), final=False,
                             stops=self._num_tokens > self._min_tokens)

    def finish(self) -> str:
        """End of generation (EOS or length): release everything still held back.

        Held stop-prefix text is real text now; a dangling incomplete UTF-8 character (the
        output cut by ``max_tokens`` inside it) is left out, as vLLM never releases the
        U+FFFD its incremental decode holds back. A stop string completed only by this flush
        still cuts the text and sets :attr:`stop_matched`. Idempotent.
        """
        if self.stop_matched is not None:
            return ""
        return self._release(self._decode_step(force=True).rstrip(_REPLACEMENT), final=True,
                             stops=self._num_tokens > self._min_tokens)
