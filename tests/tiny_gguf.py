"""Write tiny random GGUF files with ``gguf.GGUFWriter`` for fast loader tests."""

from __future__ import annotations

import gguf
import numpy as np

LLAMA_LAYER_TENSORS = {
    "attn_norm": lambda c: (c["hidden"],),
    "ffn_norm": lambda c: (c["hidden"],),
    "attn_q": lambda c: (c["heads"] * c["head_dim"], c["hidden"]),
    "attn_k": lambda c: (c["kv_heads"] * c["head_dim"], c["hidden"]),
    "attn_v": lambda c: (c["kv_heads"] * c["head_dim"], c["hidden"]),
    "attn_output": lambda c: (c["hidden"], c["heads"] * c["head_dim"]),
    "ffn_gate": lambda c: (c["ffn"], c["hidden"]),
    "ffn_up": lambda c: (c["ffn"], c["hidden"]),
    "ffn_down": lambda c: (c["hidden"], c["ffn"]),
}


# byte offsets of the float16 scale fields inside one 256-element K-quant block (ggml-common.h)
KQUANT_F16_FIELDS = {
    gguf.GGMLQuantizationType.Q4_K: (0, 2),
    gguf.GGMLQuantizationType.Q5_K: (0, 2),
    gguf.GGMLQuantizationType.Q6_K: (208,),
}


def quantize(arr: np.ndarray, qtype, rng) -> np.ndarray:
    """Quantize with ``gguf.quants`` where it can; K-quants (dequantize-only there) get random
    block bytes with small finite float16 scales, which is all a dequantization test needs."""
    if qtype not in KQUANT_F16_FIELDS:
        return gguf.quants.quantize(arr, qtype)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nblocks = arr.size // block_elems
    raw = rng.integers(0, 256, size=(nblocks, block_bytes), dtype=np.uint8)
    for off in KQUANT_F16_FIELDS[qtype]:
        scales = rng.uniform(1e-3, 1e-2, size=nblocks).astype(np.float16)
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(nblocks, 2)
    return raw.reshape(arr.shape[0], -1)


def write_tiny_llama(path, *, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256,
                     qtype=gguf.GGMLQuantizationType.Q8_0, tied=True, drop=(), extra=(),
                     seed=0) -> dict[str, np.ndarray]:
    """Write a random Llama-layout GGUF; returns {tensor name: float32 array as written (before quantization)}.

    ``drop``: tensor names to omit; ``extra``: additional tensor names (shape [hidden]) to add.
    Matrices are quantized to ``qtype``; 1-D norms stay F32.
    """
    rng = np.random.default_rng(seed)
    c = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hidden // heads, ffn=ffn)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        for n, f in LLAMA_LAYER_TENSORS.items():
            shapes[f"blk.{i}.{n}.weight"] = f(c)
    for n in extra:
        shapes[n] = (hidden,)
    written = {}
    for name, shape in shapes.items():
        if name in drop:
            continue
        arr = rng.standard_normal(shape).astype(np.float32) * (1.0 if len(shape) == 1 else 0.05)
        written[name] = arr
        if len(shape) == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quantize(arr, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
