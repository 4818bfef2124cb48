"""A real :class:`Engine` in milliseconds: a tiny random Llama GGUF (``tiny_gguf``) and a byte
tokenizer (one token per Latin-1 character, so any text round-trips; vocabulary 256).

For tests of everything above the model (the HTTP app, the engine loop, stats) that need real
engine behaviour but not real text.
"""

from __future__ import annotations

import torch

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine

VOCAB = 256


class ByteHF:
    """The part of a HF tokenizer the detokenizer and the server use."""

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class ByteTokenizer:
    """:class:`llmd.models.tokenizer.Tokenizer`'s interface over Latin-1 bytes; no EOS (so
    greedy runs always reach ``max_tokens``), a chat template of ``role: content`` lines."""

    def __init__(self):
        self.hf = ByteHF()
        self.eos_token_ids = frozenset()
        self.has_chat_template = True

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def apply_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids)


def tiny_engine(path, **config) -> Engine:
    """An engine over a fresh tiny GGUF written to ``path`` (float32, torch attention, 1 thread;
    context 512 tokens, 4 MiB of KV cache unless ``config`` says otherwise)."""
    from tiny_gguf import write_tiny_llama

    from llmd.models.gguf_loader import load_model

    write_tiny_llama(path, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=VOCAB)
    model, _ = load_model(str(path), torch.float32, "cpu")
    kw = dict(model=str(path), device="cpu", dtype="float32", attention_backend="torch",
              threads=torch.get_num_threads(), kv_cache_memory=4 * 2**20, prefix_cache_seed=0)
    return Engine(model, ByteTokenizer(), EngineConfig(**{**kw, **config}))
