"""Model configuration read from GGUF metadata alone (no tensor data is touched).

Keys follow the GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
``{arch}.block_count``, ``{arch}.embedding_length``, ``{arch}.attention.head_count`` ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf

from llmd.models.errors import GGUFLoadError


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer.

    Attributes:
        architecture: GGUF ``general.architecture`` (e.g. "llama").
        name: ``general.name`` or the file stem.
        num_layers, hidden_size, intermediate_size, vocab_size: sizes (elements).
        num_heads, num_kv_heads, head_dim: attention heads; ``num_kv_heads < num_heads`` is GQA.
        rope_theta: RoPE base frequency (``{arch}.rope.freq_base``).
        rms_norm_eps: RMSNorm epsilon.
        max_position: trained context length in tokens (``{arch}.context_length``).
        tie_word_embeddings: True when the file has no ``output.weight``.
        sliding_window: per-layer window in tokens, ``None`` for full attention.
        bos_token_id, eos_token_ids, add_bos_token: tokenizer facts from the GGUF.
        chat_template: Jinja chat template string or ``None``.
    """

    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    sliding_window: tuple[int | None, ...] = field(default=())
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    chat_template: str | None = None


def field_value(reader: gguf.GGUFReader, key: str, default=None):
    """Return the decoded value of GGUF metadata ``key`` (str, int, float, list) or ``default``."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader: gguf.GGUFReader, name: str = "") -> ModelConfig:
    """Build a :class:`ModelConfig` from a GGUF reader's metadata.

    Raises:
        GGUFLoadError: a required key is missing.
    """
    arch = field_value(reader, "general.architecture")
    if arch is None:
        raise GGUFLoadError("GGUF file has no general.architecture key")

    def req(key: str):
        v = field_value(reader, f"{arch}.{key}")
        if v is None:
            raise GGUFLoadError(f"GGUF metadata key {arch}.{key} is missing")
        return v

    hidden = int(req("embedding_length"))
    num_heads = int(req("attention.head_count"))
    num_kv_heads = int(field_value(reader, f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", hidden // num_heads))
    tensor_names = {t.name for t in reader.tensors}
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise GGUFLoadError("GGUF file has neither a vocab_size key nor tokenizer.ggml.tokens")
    num_layers = int(req("block_count"))
    eos = [field_value(reader, "tokenizer.ggml.eos_token_id"), field_value(reader, "tokenizer.ggml.eot_token_id")]
    eos_ids = tuple(sorted({int(e) for e in eos if e is not None}))
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    window = field_value(reader, f"{arch}.attention.sliding_window")
    return ModelConfig(
        architecture=arch,
        name=field_value(reader, "general.name", name) or name,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=int(vocab),
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(field_value(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        sliding_window=tuple([int(window) if window else None] * num_layers),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        add_bos_token=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=field_value(reader, "tokenizer.chat_template"),
    )
