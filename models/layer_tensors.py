"""Per-architecture GGUF layer tensors: stem (``blk.N.<stem>.weight``) → where it lands inside a
decoder block, a parameter path or ``(fused module, part)`` (parts of one fused projection).

Plain data, torch-free: the model classes take their ``layer_tensors`` from here, and ``llmd
kv-size --total-memory`` (:func:`llmd.models.registry.layer_tensors`) sizes the weights from the
cached GGUF header without importing torch. Stems are llama.cpp's
(``gguf.constants.MODEL_TENSORS``).
"""

from __future__ import annotations

LLAMA = {
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": ("self_attn.qkv_proj", "q"), "attn_k": ("self_attn.qkv_proj", "k"),
    "attn_v": ("self_attn.qkv_proj", "v"), "attn_output": "self_attn.o_proj.weight",
    "ffn_gate": ("mlp.gate_up_proj", "gate"), "ffn_up": ("mlp.gate_up_proj", "up"),
    "ffn_down": "mlp.down_proj.weight",
}

QWEN3 = {
    **LLAMA,
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
}

GEMMA3 = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": ("self_attn.qkv_proj", "q"),
    "attn_k": ("self_attn.qkv_proj", "k"),
    "attn_v": ("self_attn.qkv_proj", "v"),
    "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "ffn_gate": ("mlp.gate_up_proj", "gate"),
    "ffn_up": ("mlp.gate_up_proj", "up"),
    "ffn_down": "mlp.down_proj.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight",
}

#: GGUF ``general.architecture`` → its table
BY_ARCHITECTURE = {"llama": LLAMA, "qwen3": QWEN3, "gemma3": GEMMA3}
