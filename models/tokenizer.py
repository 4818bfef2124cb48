"""Tokenizer and chat template from a GGUF file, through HF ``transformers`` (offline).

``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)`` rebuilds a fast tokenizer from the
GGUF's vocabulary (seconds for a 49k vocabulary); the result is saved once under the XDG cache dir,
keyed by the GGUF's identity (header digest + file size) and the transformers version, written
to a temporary directory and renamed into place (atomic), so later starts take a second or two.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from llmd.models.config import ModelConfig
from llmd.models.errors import LlmdError
from llmd.models.paths import cache_dir as default_cache_dir
from llmd.models.paths import ensure_cache_dir


def gguf_identity(path: str, header_bytes: int) -> str:
    """Hex digest identifying a GGUF file: sha256 of its metadata header plus its size in bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(header_bytes))
    h.update(str(os.path.getsize(path)).encode())
    return h.hexdigest()[:32]


class Tokenizer:
    """Wraps a HF tokenizer with llmd's BOS and end-of-turn rules.

    Attributes:
        hf: the ``transformers`` tokenizer (decode, convert_ids_to_tokens, ...).
        eos_token_ids: frozenset of ids that end a sequence (GGUF eos + eot).
        has_chat_template: whether ``apply_chat`` is possible.
    """

    def __init__(self, hf, config: ModelConfig):
        self.hf = hf
        self.config = config
        self.bos_token_id = config.bos_token_id
        self.add_bos = config.add_bos_token and config.bos_token_id is not None
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.has_chat_template = bool(config.chat_template)

    def _with_bos(self, ids: list[int]) -> list[int]:
        # GGUF ``tokenizer.ggml.add_bos_token`` decides; never two BOS.
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            return [self.bos_token_id] + ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Text → token ids (BOS prepended iff the GGUF asks for it)."""
        return self._with_bos(self.hf.encode(text, add_special_tokens=False))

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render ``messages`` ([{"role", "content"}]) with the GGUF's chat template → token ids.

        Raises:
            LlmdError: the model has no chat template, or the template refused the messages
                (its ``raise_exception``, e.g. roles that do not alternate: a client error, 400
                in vLLM too).
        """
        if not self.has_chat_template:
            raise LlmdError(f"model {self.config.name} has no chat template; drop --chat / use /v1/completions")
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise LlmdError(f"the chat template of {self.config.name} refused the messages: {e}") from None
        return self._with_bos(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(gguf_path: str, config: ModelConfig, header_bytes: int, cache_dir: str | None = None) -> Tokenizer:
    """Load (or build and cache) the tokenizer of a GGUF file.

    Args:
        gguf_path: the GGUF file.
        config: its :class:`ModelConfig` (BOS / EOS / template facts).
        header_bytes: size of the GGUF metadata header (``GGUFReader.data_offset``), hashed as identity.
        cache_dir: override for the cache root (tests).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import PreTrainedTokenizerFast  # not AutoTokenizer: it imports modeling_auto

    key = f"{gguf_identity(gguf_path, header_bytes)}-tf{transformers.__version__}"
    root = os.path.join(cache_dir, "tokenizers") if cache_dir else default_cache_dir("tokenizers")
    target = os.path.join(root, key)
    if os.path.isdir(target):
        try:
            return Tokenizer(PreTrainedTokenizerFast.from_pretrained(target, local_files_only=True), config)
        except Exception:
            shutil.rmtree(target, ignore_errors=True)  # a corrupt cache entry is rebuilt
    hf = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                                 gguf_file=os.path.basename(gguf_path), local_files_only=True)
    if cache_dir:
        os.makedirs(root, exist_ok=True)
    else:
        ensure_cache_dir("tokenizers")  # 0700, as the whole llmd cache
    tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-")
    try:
        hf.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:  # another process won the race, or the cache is read-only
        shutil.rmtree(tmp, ignore_errors=True)
    return Tokenizer(hf, config)
