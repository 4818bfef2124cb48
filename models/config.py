"""Model configuration read from GGUF metadata alone (no tensor data is touched).

Keys follow the GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
``{arch}.block_count``, ``{arch}.embedding_length``, ``{arch}.attention.head_count`` ...
Architecture facts a GGUF does not always carry (Gemma 3's local/global layer pattern, its local
RoPE base, its embedding scale) come from :data:`ARCH_DEFAULTS`, overridden by metadata keys
when present (``{arch}.attention.sliding_window_pattern``, ``{arch}.rope.freq_base_swa``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
        sliding_window: per layer, the attention window ``W`` in tokens (query ``p`` sees keys
            ``[p - W + 1, p]``) or ``None`` for full (global) attention; ``()`` = all global.
        rope_thetas: per layer, the RoPE base frequency that layer uses (Gemma 3: 10,000 on
            local layers, ``rope_theta`` on global ones); ``()`` = ``rope_theta`` everywhere.
        embedding_scale: factor applied to token embeddings (Gemma: ``sqrt(hidden_size)``, cast
            to the activation dtype first, as HF does); 1.0 for Llama.
        attention_scale: softmax scale on ``q·k``; ``None`` = ``head_dim ** -0.5``
            (``{arch}.attention.scale`` when the GGUF has it).
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
    rope_thetas: tuple[float, ...] = field(default=())
    embedding_scale: float = 1.0
    attention_scale: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    chat_template: str | None = None

    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer ``i`` in tokens, or None (full attention)."""
        return self.sliding_window[i] if self.sliding_window else None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's sliding window (tokens) or None, ``num_layers`` entries (all None
        when the model has no sliding-window layers)."""
        return self.sliding_window or (None,) * self.num_layers

    def layer_rope_theta(self, i: int) -> float:
        """RoPE base frequency of layer ``i``."""
        return self.rope_thetas[i] if self.rope_thetas else self.rope_theta

    @property
    def softmax_scale(self) -> float:
        """``attention_scale`` or ``head_dim ** -0.5``."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale


# Per-architecture facts the GGUF may omit. Gemma 3 (HF ``Gemma3TextConfig``; llama.cpp
# ``LLM_ARCH_GEMMA3``): every 6th layer global (layers 5, 11, 17 of 18), local RoPE base
# 10,000, embeddings scaled by sqrt(hidden_size).
ARCH_DEFAULTS: dict[str, dict] = {
    "gemma3": {"sliding_window_pattern": 6, "rope_freq_base_swa": 10000.0, "embedding_scale": "sqrt_hidden"},
}


def sliding_layers(pattern, num_layers: int) -> list[bool]:
    """Which layers use the sliding window, from a ``sliding_window_pattern`` value.

    ``pattern``: None (every layer local), an int ``n`` (layer ``i`` is global iff
    ``(i + 1) % n == 0``; ``n == 0`` means all local, as in llama.cpp's ``set_swa_pattern``), or
    a per-layer list of bools (True = local), as llama.cpp writes for some architectures.
    """
    if pattern is None:
        return [True] * num_layers
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise GGUFLoadError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return [bool(p) for p in pattern]
    n = int(pattern)
    return [n == 0 or (i + 1) % n != 0 for i in range(num_layers)]


def field_value(reader, key: str, default=None):
    """Return the decoded value of GGUF metadata ``key`` (str, int, float, list) or ``default``."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader, name: str = "") -> ModelConfig:
    """Build a :class:`ModelConfig` from a GGUF reader's metadata.

    ``reader``: a ``gguf.GGUFReader``
    (anything with ``fields[key].contents()`` and ``tensors[i].name``).

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
        tokens = field_value(reader, "tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise GGUFLoadError("GGUF file has neither a vocab_size key nor tokenizer.ggml.tokens")
    num_layers = int(req("block_count"))
    eos = [field_value(reader, "tokenizer.ggml.eos_token_id"), field_value(reader, "tokenizer.ggml.eot_token_id")]
    eos_ids = tuple(sorted({int(e) for e in eos if e is not None}))
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    defaults = ARCH_DEFAULTS.get(arch, {})
    window = field_value(reader, f"{arch}.attention.sliding_window")
    rope_theta = float(field_value(reader, f"{arch}.rope.freq_base", 10000.0))
    local_theta = float(field_value(reader, f"{arch}.rope.freq_base_swa",
                                    defaults.get("rope_freq_base_swa", rope_theta)))
    if window:
        pattern = field_value(reader, f"{arch}.attention.sliding_window_pattern",
                              defaults.get("sliding_window_pattern"))
        local = sliding_layers(pattern, num_layers)
    else:
        local = [False] * num_layers
    scale = field_value(reader, f"{arch}.attention.scale")
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
        rope_theta=rope_theta,
        rms_norm_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(field_value(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        sliding_window=tuple(int(window) if is_local else None for is_local in local),
        rope_thetas=tuple(local_theta if is_local else rope_theta for is_local in local),
        embedding_scale=math.sqrt(hidden) if defaults.get("embedding_scale") == "sqrt_hidden" else 1.0,
        attention_scale=None if scale is None else float(scale),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        add_bos_token=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=field_value(reader, "tokenizer.chat_template"),
    )
