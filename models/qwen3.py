"""Qwen3 dense decoder (Qwen3-0.6B .. 32B) from GGUF: the Llama skeleton plus per-head Q/K RMSNorm.

Reference: HF transformers ``models/qwen3/modeling_qwen3.py`` (``Qwen3Attention``: ``q_norm`` /
``k_norm``, one ``Qwen3RMSNorm`` of ``head_dim`` weights each, applied to every head of Q and K
before RoPE; the norm is Llama's RMSNorm formula); GGUF tensor names from llama.cpp
(``gguf.constants.MODEL_TENSORS[MODEL_ARCH.QWEN3]``: Llama's plus ``blk.N.attn_q_norm.weight``
and ``blk.N.attn_k_norm.weight``, ``[head_dim]`` each). ``head_dim`` comes from the GGUF's
``qwen3.attention.key_length`` (Qwen3-0.6B: 128 with hidden 1024 and 16 heads, so the Q
projection is wider than the hidden size).

GGUF quirk: Q/K rows are *not* permuted. llama.cpp's ``convert_hf_to_gguf.py`` ``Qwen3Model``
(via ``Qwen2Model.modify_tensors``) only renames tensors, and llama.cpp runs the architecture
with NEOX (rotate-half) RoPE, like HF; only the ``llama`` architecture's converter permutes.
"""

from __future__ import annotations

from llmd.models.decoder import DecoderForCausalLM
from llmd.models.layer_tensors import QWEN3
from llmd.models.layers import RMSNorm
from llmd.models.llama import LlamaDecoderLayer

LAYER_TENSORS = QWEN3  # Llama's plus the per-head Q/K norms


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """One pre-norm Qwen3 block: Llama's (``x + attn(norm(x))``, then ``x + mlp(norm(x))``,
    SwiGLU) with Q and K RMS-normed per head before RoPE.

    ``forward(x [T, hidden], rope (cos, sin) [T, 1, head_dim], kv_cache, meta) -> [T, hidden]``.
    """

    qk_norm = True


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 decoder (see :class:`DecoderForCausalLM` for the interface); GGUF tensors used as
    stored (no Q/K un-permutation, no norm offset)."""

    layer_cls = Qwen3DecoderLayer
    norm_cls = RMSNorm
    layer_tensors = LAYER_TENSORS
