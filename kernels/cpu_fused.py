"""A whole decode step of one sequence in one C call (``kernels/native/fused_decode.c``): the
single-stream (batch-1 chat) path of Llama-architecture models on the cpu backend.

At batch 1 the torch path's step is ~27 small kernels per layer plus torch's weight-only matmuls,
whose call overheads alone add up to about llama.cpp's whole token. The fused kernel runs every
layer (RMSNorm, Q4/Q8 products over the GGUF's own blocks with int8 activations, RoPE, the K/V
store, paged attention, SwiGLU, residuals), the final norm and the LM head in one OpenMP region
(torch's thread team) and returns float32 logits. The file docstring of ``fused_decode.c``
gives the numerics; :mod:`llmd.quant.native_packs` the weight layout.

:class:`FusedDecoder` holds the ctypes structures (pointers into tensors it keeps alive) built
once per runner; the model file decides whether its architecture maps onto it
(:meth:`llmd.models.llama.LlamaForCausalLM.fused_decoder`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from llmd.kernels import cpu_native
from llmd.kernels.native import build
from llmd.quant.kv import planes_contiguous

_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # paged_decode.c's KV_F32 / KV_BF16 / KV_F16
_EMBED_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # Q_F32 / Q_BF16


class _Mat(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("kind", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("qkv", _Mat), ("o", _Mat),
                ("gate_up", _Mat), ("down", _Mat), ("kv", ctypes.c_void_p), ("kv_plane", ctypes.c_int64),
                ("window", ctypes.c_int)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("inter", ctypes.c_int), ("num_layers", ctypes.c_int),
                ("block_size", ctypes.c_int), ("kv_dtype", ctypes.c_int), ("eps", ctypes.c_float),
                ("attn_scale", ctypes.c_float), ("act_levels", ctypes.c_int), ("inv_freq", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p),
                ("head", _Mat)]


@dataclass
class FusedLayer:
    """One decoder layer for the kernel.

    Attributes:
        attn_norm, ffn_norm: ``[hidden]`` RMSNorm weights (any float dtype; kept as float32).
        qkv, o, gate_up, down: ``(kind, pack)`` of :mod:`llmd.quant.native_packs`, shapes
            ``[(heads + 2 kv_heads) · head_dim, hidden]`` (Q rows, K rows, V rows; NEOX order),
            ``[hidden, heads · head_dim]``, ``[2 · inter, hidden]`` (gate rows, then up),
            ``[hidden, inter]``.
        kv: the layer's cache data ``[2, num_blocks, block_size, kv_heads, head_dim]``, float32
            or bfloat16 (``auto``), each plane contiguous (:func:`llmd.quant.kv.planes_contiguous`).
        window: sliding window in tokens, or None.
    """

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: tuple
    o: tuple
    gate_up: tuple
    down: tuple
    kv: torch.Tensor
    window: int | None = None


def why_not(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
            kv: torch.Tensor, mats: list[tuple]) -> str | None:
    """Why the kernel cannot run this model (None: it can). Its limits: hidden, inter and heads ·
    head_dim multiples of 32 up to 16,384, head_dim a multiple of 16 up to 256, ≤ 16 query heads per
    KV head, blocks of ≤ 128 tokens, a float32/bfloat16 contiguous cache, every product packed
    (:mod:`llmd.quant.native_packs`: rows a multiple of 16)."""
    if hidden % 32 or inter % 32 or heads * head_dim % 32 or max(hidden, inter, heads * head_dim) > 16384:
        return f"hidden {hidden} / intermediate {inter} / heads x head_dim not multiples of 32 up to 16384"
    if head_dim % 16 or head_dim > 256 or heads % kv_heads or heads // kv_heads > 16:
        return f"head_dim {head_dim} / {heads} heads over {kv_heads} KV heads past the kernel's limits"
    if block_size > cpu_native.MAX_BLOCK:
        return f"block size {block_size} > {cpu_native.MAX_BLOCK}"
    if kv.dtype not in _KV_DTYPES or not planes_contiguous(kv):
        return f"KV cache {str(kv.dtype).removeprefix('torch.')} (needs float32, bfloat16 or float16)"
    if any(m is None for m in mats):
        return "a layer without the GGUF 4/8-bit blocks (needs --weight-quant auto or gguf, Q4_0/Q4_1/Q4_K/Q8_0)"
    return None


def _mat(kind_pack: tuple, keep: list) -> _Mat:
    kind, pack = kind_pack
    keep.extend(pack)
    codes, scales = pack[0], pack[1]
    mins = pack[2] if len(pack) > 2 else None
    cols = codes.shape[1] * (2 if kind == "q4" else 1)
    return _Mat(codes.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(),
                codes.shape[0], cols, 0 if kind == "q4" else 1)


class FusedDecoder:
    """Decode one token of one sequence through every layer and the head (see the module docstring).

    Args:
        layers: one :class:`FusedLayer` per decoder layer; ``final_norm``: ``[hidden]``;
        head: ``(kind, pack)`` ``[vocab, hidden]``; ``embed``: the token table ``[vocab, hidden]``
            float32 or bfloat16 (read by row); ``heads``, ``kv_heads``, ``head_dim``, ``eps``,
            ``scale`` (softmax), ``rope_theta``, ``block_size``: the model's.
        act_levels: 1 = each product's input as int8 codes per block of 32 (llama.cpp's Q8_1
            activations); 2 (default) = plus int8 codes of each value's rounding residual (a
            second VNNI product over the same weight bytes; README "Single-stream decode" has the
            quality and speed of both).
        specialize: the library built for this shape (:func:`llmd.kernels.native.build.load_fused`;
            ~3 s the first time on a machine), else the runtime-shape one (tests of many shapes).
    Raises:
        RuntimeError: the kernel library is unavailable (check :func:`available` first).
    """

    def __init__(self, layers: list[FusedLayer], final_norm: torch.Tensor, head: tuple, embed: torch.Tensor,
                 heads: int, kv_heads: int, head_dim: int, eps: float, scale: float, rope_theta: float,
                 block_size: int, act_levels: int = 2, specialize: bool = True):
        self.lib = build.load_fused((head_dim // 16, heads // kv_heads) if specialize else None)
        if self.lib is None:
            raise RuntimeError(f"fused decode kernel unavailable: {build.fused_why_not}")
        keep: list = []  # every tensor a pointer refers to
        f32 = [t.detach().float().contiguous() for t in (final_norm,)]
        keep += f32
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = (1.0 / (rope_theta**exponents)).contiguous()  # as models.layers.rope_tables (HF)
        keep.append(inv_freq)
        self.embed = embed
        self.hidden, self.vocab = embed.shape[1], head[1][0].shape[0]
        inter = layers[0].down[1][0].shape[1] * (2 if layers[0].down[0] == "q4" else 1) if layers else 64
        structs = (_Layer * len(layers))()
        for i, lay in enumerate(layers):
            norms = [lay.attn_norm.detach().float().contiguous(), lay.ffn_norm.detach().float().contiguous()]
            keep += norms + [lay.kv]
            structs[i] = _Layer(norms[0].data_ptr(), norms[1].data_ptr(), _mat(lay.qkv, keep), _mat(lay.o, keep),
                                _mat(lay.gate_up, keep), _mat(lay.down, keep), lay.kv.data_ptr(), lay.kv.stride(0),
                                lay.window or 0)
        self.model = _Model(self.hidden, heads, kv_heads, head_dim, inter, len(layers), block_size,
                            _KV_DTYPES[layers[0].kv.dtype] if layers else 0, eps, scale, act_levels,
                            inv_freq.data_ptr(), f32[0].data_ptr(),
                            _mat(head, keep))
        self.layers, self._keep = structs, keep
        self.work = torch.empty(self.hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * inter
                                + head_dim, dtype=torch.float32)

    def __call__(self, token: int, position: int, slot: int, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Logits ``[1, vocab]`` float32 (a new tensor) of the token ``token``
        at ``position``, whose K/V go to cache slot ``slot``; ``block_table``: the sequence's
        ``[max_blocks]`` int32 row (contiguous) covering ``seq_len`` tokens (this one included).

        Raises:
            ValueError: the kernel refused the sizes (not expected after :func:`why_not`)."""
        row, logits = self.embed[token], torch.empty(1, self.vocab, dtype=torch.float32)
        rc = self.lib.llmd_fused_decode(
            ctypes.byref(self.model), self.layers, row.data_ptr(), _EMBED_DTYPES[row.dtype], position, slot,
            block_table.data_ptr(), seq_len, logits.data_ptr(), self.work.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"fused decode kernel refused the step ({rc})")
        return logits


def available(head_dim: int, group: int) -> bool:
    """The fused kernel builds and runs on this CPU for this shape (first call builds, ~3 s)."""
    return build.load_fused((head_dim // 16, group)) is not None
