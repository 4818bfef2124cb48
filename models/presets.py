"""Random-weight models of real shapes, for GPU benchmarks on a machine with only torch
(+ triton, transformers): ``--model random:<preset>`` (e.g. ``random:qwen3-0.6b``), optionally
``random:<preset>:layers=N`` for a shallower model of the same layer shape (smoke runs, tests).

No GGUF, no ``gguf`` package and no model package are involved: the :class:`ModelConfig` is
written out below and the weights are drawn on the target device directly, in the model dtype,
from one seeded ``torch.Generator`` of that device (:func:`build_random_model`). Prompts are token
ids (:class:`NumericTokenizer`); outputs decode to ids too.

Shapes are those of the HF ``config.json`` files:
- ``qwen3-0.6b``: Qwen/Qwen3-0.6B — 28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128,
  intermediate 3072, vocab 151,936, rope_theta 1e6, rms_norm_eps 1e-6, tied embeddings, 40,960
  positions.
- ``llama-3-8b``: meta-llama/Meta-Llama-3-8B — 32 layers, hidden 4096, 32 heads, 8 KV heads,
  head_dim 128, intermediate 14,336, vocab 128,256, rope_theta 5e5, rms_norm_eps 1e-5, separate
  LM head, 8,192 positions.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from llmd.models.config import ModelConfig
from llmd.models.errors import LlmdError, ModelNotFoundError, NoChatTemplateError

if TYPE_CHECKING:
    import torch

RANDOM_PREFIX = "random:"
WEIGHT_STD = 0.02  # N(0, 0.02²) matrices (HF's initializer_range): activations stay O(1) in bf16/fp16

PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", name="random Qwen3-0.6B", num_layers=28, hidden_size=1024, intermediate_size=3072,
        num_heads=16, num_kv_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position=40960, tie_word_embeddings=True),
    "llama-3-8b": ModelConfig(
        architecture="llama", name="random Meta-Llama-3-8B", num_layers=32, hidden_size=4096,
        intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256, rope_theta=5e5,
        rms_norm_eps=1e-5, max_position=8192, tie_word_embeddings=False),
}


def is_random_model(name: str) -> bool:
    """Whether ``--model`` names a random-weight preset (``random:...``)."""
    return name.startswith(RANDOM_PREFIX)


def preset_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of ``random:<preset>[:layers=N]``.

    Raises:
        ModelNotFoundError: unknown preset (the message lists the known ones).
        LlmdError: a malformed ``:layers=N`` suffix (N must be in 1..the preset's layers).
    """
    spec = name[len(RANDOM_PREFIX):] if is_random_model(name) else name
    preset, _, option = spec.partition(":")
    cfg = PRESETS.get(preset)
    if cfg is None:
        known = ", ".join(RANDOM_PREFIX + p for p in sorted(PRESETS))
        raise ModelNotFoundError(f"unknown random-weight preset {preset!r}: use one of {known}")
    if not option:
        return cfg
    key, _, value = option.partition("=")
    if key != "layers" or not value.isdigit() or not 1 <= int(value) <= cfg.num_layers:
        raise LlmdError(f"--model {name}: the only option is :layers=N with 1 <= N <= {cfg.num_layers}")
    return dataclasses.replace(cfg, num_layers=int(value), name=f"{cfg.name} ({value} layers)")


def build_random_model(cfg: ModelConfig, dtype: "torch.dtype", device: "str | torch.device", seed: int = 0,
                       std: float = WEIGHT_STD):
    """The architecture's model with random weights, allocated on ``device`` in ``dtype``.

    Every matrix (embeddings, projections, LM head) is ``N(0, std²)`` drawn in ``dtype`` by one
    ``torch.Generator(device)`` seeded with ``seed``, in ``named_parameters()`` order, so the
    same (seed, device, dtype) gives the same weights; every norm weight is 1. Returns the model
    in eval mode. (torch is imported here, not with the module: ``llmd kv-size`` reads the
    presets' configs without it.)
    """
    import torch

    from llmd.models.registry import model_class

    cls = model_class(cfg.architecture)
    with torch.device(device):
        model = cls(cfg, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return model.eval()


class _NumericHF:
    """The HF-tokenizer calls the detokenizer and the server make: token ``i`` is the string
    ``" i"``, so a decoded output is the space-separated ids."""

    def convert_ids_to_tokens(self, ids):
        return [f" {i}" for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {i}" for i in ids)


class NumericTokenizer:
    """Tokenizer of the random presets (the :class:`~llmd.models.tokenizer.Tokenizer` interface).

    ``encode("15 27 3")`` → ``[15, 27, 3]`` (whitespace-separated decimal ids); any other text →
    its UTF-8 bytes as ids (0..255). No BOS, no EOS (runs go to ``max_tokens``), no chat template.
    """

    def __init__(self, config: ModelConfig):
        self.config = config
        self.hf = _NumericHF()
        self.eos_token_ids: frozenset[int] = frozenset()
        self.has_chat_template = False

    def encode(self, text: str) -> list[int]:
        words = text.split()
        if words and all(w.isdigit() for w in words):
            return [int(w) for w in words]
        return list(text.encode("utf-8"))

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        raise NoChatTemplateError("this model has no chat template (a base model), so it cannot format chat "
                                 "messages: send a plain prompt (/v1/completions, llmd generate without --chat)")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids)


def load_random_model(name: str, dtype: "torch.dtype", device: "str | torch.device", seed: int = 0):
    """``(model, config, tokenizer)`` for ``random:<preset>[:layers=N]``. Raises as :func:`preset_config`."""
    cfg = preset_config(name)
    return build_random_model(cfg, dtype, device, seed), cfg, NumericTokenizer(cfg)
