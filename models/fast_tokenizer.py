"""The transformers fast-tokenizer calls llmd makes, answered by the ``tokenizers`` backend itself.

``transformers.PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5) delegates
encode / decode / ids → tokens → text to its Rust ``tokenizers.Tokenizer``; importing
transformers and building that wrapper is ~0.7 s of a warm start. A cached tokenizer directory
(``tokenizer.json`` as transformers saved it) plus :data:`META_FILE`, written once from the
transformers tokenizer (:func:`describe`), gives the same answers with the backend alone:

* ``encode(text, add_special_tokens=False)``: ``backend.encode_batch([text], ...)[0].ids``, as
  transformers calls it (no truncation, no padding, special tokens matched: transformers'
  settings for that call). ``encode_batch``, not ``encode``: only the batch call releases the GIL
  while Rust tokenizes (a 500k-character prompt holds it ~0.2 s otherwise, stalling the event loop
  and the engine thread's streams: ``tests/e2e/test_stream_isolation.py``).
* ``decode(ids, skip_special_tokens)``: ``backend.decode`` (no clean-up: :func:`describe` only
  marks a tokenizer exact when ``clean_up_tokenization_spaces`` and ``split_special_tokens`` are
  off and its backend serializes identically to the saved ``tokenizer.json``).
* ``convert_ids_to_tokens`` / ``convert_tokens_to_string``: ``id_to_token`` / ``decoder.decode``.
* ``apply_chat_template(messages, tokenize=False, ...)``: :mod:`llmd.models.chat_template`.
* ``all_special_ids``, ``special_tokens_map``, ``added_tokens_decoder``, ``chat_template``.

:attr:`FastTokenizer.transformers` loads the real transformers tokenizer on first use (for
xgrammar's ``TokenizerInfo.from_huggingface``, i.e. the first structured-output request). Tested
equal to transformers on SmolLM2 and Gemma 3 in ``tests/models/test_fast_tokenizer.py``.
"""

from __future__ import annotations

import json
import os
import threading

META_FILE = "llmd_tokenizer.json"
META_FORMAT = 1


def describe(hf, directory: str) -> dict:
    """What :class:`FastTokenizer` needs from a transformers fast tokenizer saved in ``directory``,
    with ``exact``: whether the backend alone answers as ``hf`` does (see the module docstring)."""
    import tokenizers

    template = hf.chat_template
    exact = (not hf.clean_up_tokenization_spaces and not getattr(hf, "split_special_tokens", False)
             and (template is None or isinstance(template, str))
             and tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")).to_str()
             == hf.backend_tokenizer.to_str())
    return {"format": META_FORMAT, "exact": bool(exact), "special_tokens_map": dict(hf.special_tokens_map),
            "all_special_ids": [int(i) for i in hf.all_special_ids],
            "chat_template": template if isinstance(template, str) else None}


def write_meta(directory: str, meta: dict) -> None:
    """Write :data:`META_FILE` into ``directory`` (temporary file + rename; a read-only cache is
    no error: the next start asks transformers again)."""
    tmp = os.path.join(directory, f".{META_FILE}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(directory, META_FILE))
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def read_meta(directory: str) -> dict | None:
    """The directory's :data:`META_FILE` when it is of this format (exact or not), else None."""
    try:
        with open(os.path.join(directory, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or not isinstance(meta.get("exact"), bool):
        return None
    return meta


class FastTokenizer:
    """A transformers fast tokenizer's llmd-facing calls over its ``tokenizers`` backend.

    Args:
        backend: the ``tokenizers.Tokenizer`` (the one of ``tokenizer.json``, or ``hf.backend_tokenizer``).
        meta: :func:`describe`'s result (exact).
        directory: the saved tokenizer directory (where :attr:`transformers` loads from).
        hf: the transformers tokenizer when one is loaded already (a cold start), else None.
    """

    def __init__(self, backend, meta: dict, directory: str, hf=None):
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False
        self.backend = backend
        self.directory = directory
        self.special_tokens_map: dict[str, str] = dict(meta["special_tokens_map"])
        self.all_special_ids: list[int] = list(meta["all_special_ids"])
        self.chat_template: str | None = meta["chat_template"]
        self.added_tokens_decoder = dict(sorted(backend.get_added_tokens_decoder().items()))
        self._hf = hf
        self._hf_lock = threading.Lock()

    @classmethod
    def from_directory(cls, directory: str) -> "FastTokenizer | None":
        """The tokenizer saved in ``directory``, or None when its :data:`META_FILE` is missing or
        not exact.
        Raises what ``tokenizers.Tokenizer.from_file`` raises for a corrupt ``tokenizer.json``."""
        meta = read_meta(directory)
        if meta is None or not meta["exact"]:
            return None
        import tokenizers

        return cls(tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")), meta, directory)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids  # releases the GIL

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else ()
        return [self.backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        """The rendered chat text (``tokenize=False`` only). Raises ValueError without a template,
        ``jinja2.TemplateError`` when the template refuses the messages."""
        if tokenize:
            raise ValueError("FastTokenizer.apply_chat_template renders text only (tokenize=False)")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        from llmd.models.chat_template import render_chat

        return render_chat(self.chat_template, messages, self.special_tokens_map, add_generation_prompt)

    @property
    def transformers(self):
        """The transformers ``PreTrainedTokenizerFast`` of the same directory, loaded on first use
        (~0.7 s: transformers' import and the wrapper; e.g. for xgrammar)."""
        with self._hf_lock:
            if self._hf is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                from transformers import PreTrainedTokenizerFast

                self._hf = PreTrainedTokenizerFast.from_pretrained(self.directory, local_files_only=True)
            return self._hf
