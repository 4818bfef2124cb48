"""Weight bytes per ``--weight-quant`` from GGUF tensor infos alone (``llmd kv-size --total-memory``).

Mirrors what :func:`llmd.models.weight_quant.quantize_linears` keeps (tested equal to a load's
summary in ``tests/models/test_weight_quant.py``), without torch, numpy or gguf: the tensor
infos come from :mod:`llmd.models.header_cache` and the GGML type ids are the GGUF spec's
(equal to :data:`llmd.quant.gguf_packs.INT4_TYPES` / ``INT8_TYPES``, tested).
"""

from __future__ import annotations

GROUP = 32  # the int4 kernels' group size (llmd.quant.gguf_packs.GROUP)
INT4_TYPES = frozenset({2, 3, 12})  # Q4_0, Q4_1, Q4_K
INT8_TYPES = frozenset({8})  # Q8_0
BNB_BLOCK, BNB_TILE = 64, 32  # bitsandbytes' 4-bit block, and the row tile of its CPU layout (llmd.quant.bnb_linear)


def bnb_4bit_bytes(n: int, k: int, cpu_layout: bool) -> int:
    """Bytes of an ``[n, k]`` weight in bitsandbytes NF4/FP4 (:mod:`llmd.quant.bnb_linear`): half a
    byte per weight plus one absmax per 64 weights, float32 (bitsandbytes' format; no double
    quantization), or bfloat16 in its AVX512-BF16 CPU layout (``cpu_layout``, which needs
    ``n % 32 == 0`` and ``k % 64 == 0``; other shapes stay in the float32 format)."""
    blocks = -(-n * k // BNB_BLOCK)
    absmax = 2 if cpu_layout and n % BNB_TILE == 0 and k % BNB_BLOCK == 0 else 4
    return (n * k + 1) // 2 + blocks * absmax


def cpu_flags() -> set[str]:
    """The first CPU's ``flags`` in ``/proc/cpuinfo`` (torch-free); empty where the file is absent."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_has_avx512_bf16() -> bool:
    """Whether ``/proc/cpuinfo`` lists ``avx512_bf16`` (torch-free: what selects bitsandbytes' CPU
    layout, whose own probe is its native ``has_avx512bf16_cpu``); False where the file is absent."""
    return "avx512_bf16" in cpu_flags()


def cpu_runs_fused_decode() -> bool:
    """Whether ``/proc/cpuinfo`` lists what the fused decode kernel is built for
    (``kernels/native/fused_decode.c``): AVX512-VNNI with AVX512-BW/VL, or AVX2 with FMA and F16C
    (torch-free); False where the file is absent."""
    flags = cpu_flags()
    return {"avx512_vnni", "avx512bw", "avx512vl"} <= flags or {"avx2", "fma", "f16c"} <= flags


def weight_bytes(tensors: dict, layer_tensors: dict, mode: str, elem_bytes: int, keep_dense: bool = False,
                 bnb_cpu_layout: bool = False, fused: bool = False) -> int:
    """Bytes :func:`quantize_linears` leaves in memory for ``mode``, from GGUF tensor infos alone.

    Args:
        tensors: GGUF tensor name → ``GGUFReader`` tensor (only ``tensor_type`` and ``shape`` are read).
        layer_tensors: the architecture's ``layer_tensors`` (GGUF stem → parameter, or
            ``(fused module, part)``): parts of one fused projection are one layer, as at load.
        mode: one of :data:`WEIGHT_QUANT_MODES`; elem_bytes: the model dtype's bytes (2 for bfloat16).
        keep_dense: packed layers keep their dense weights too (``--weight-quant auto``).
        bnb_cpu_layout: ``nf4`` / ``fp4`` layers in bitsandbytes' CPU layout (a bfloat16 model on an
            AVX512-BF16 CPU), see :func:`bnb_4bit_bytes`.
        fused: ``gguf`` layers also hold the fused decode kernel's copy (:mod:`llmd.quant.native_packs`:
            4-bit codes with a float16 scale and min per 32, or Q8_0 int8 codes with a float16 scale).
    Returns:
        Weight bytes (int4 packs: K/2 bytes per row and a (scale, zero) pair per 32; ``int8``: K
        bytes per row and one scale per 32 (bfloat16 rows in multiples of 32: the nibble-split
        pack's two bfloat16 (scale, zero) pairs, 8 B, per 32); per-row int8 (``gguf``'s Q8_0 and
        head): K bytes per row and one scale; nf4 / fp4: :func:`bnb_4bit_bytes`; dense: ``elem_bytes``
        per element), embedding table included.
    """
    groups: dict = {}
    total = 0
    for name, t in tensors.items():
        n_rows, k = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else (1, int(t.shape[0]))
        parts = name.split(".")
        stem = parts[2] if name.startswith("blk.") and len(parts) == 4 else None
        target = layer_tensors.get(stem) if stem else None
        if len(t.shape) != 2 or name == "token_embd.weight" or target is None and name != "output.weight":
            total += n_rows * k * elem_bytes  # norms, the embedding table
        if len(t.shape) == 2 and (target is not None or name == "output.weight"):
            key = (parts[1], target[0]) if isinstance(target, tuple) else name
            groups.setdefault(key, []).append((t.tensor_type, n_rows, k))
    tied = "output.weight" not in tensors
    if tied and mode != "none":  # a packed head beside the embedding table (which batches reuse)
        emb = tensors["token_embd.weight"]
        groups["lm_head"] = [(emb.tensor_type, int(emb.shape[1]), int(emb.shape[0]))]
    for key, members in groups.items():
        types = {m[0] for m in members}
        n, k = sum(m[1] for m in members), members[0][2]
        head = key in ("lm_head", "output.weight")
        extra = n * k * elem_bytes if keep_dense and key != "lm_head" else 0  # a tied head reuses the table
        if mode == "none":
            total += n * k * elem_bytes
        elif mode in ("nf4", "fp4"):
            total += bnb_4bit_bytes(n, k, bnb_cpu_layout)
        elif mode == "gguf" and types <= INT4_TYPES and k % GROUP == 0 and n % 16 == 0:
            total += n * k // 2 + n * (k // GROUP) * 2 * elem_bytes + extra
            total += n * k // 2 + n * (k // GROUP) * 4 if fused else 0
        elif mode == "int8" and k % GROUP == 0:  # llmd.quant.int8_groups.pack: codes + a scale per 32
            per_group = 8 if elem_bytes == 2 and n % 32 == 0 else elem_bytes  # the nibble pack's 2 (scale, zero)
            total += n * k + n * (k // GROUP) * per_group + extra
        elif mode == "int8" or types <= INT8_TYPES or head:
            total += n * k + n * elem_bytes + extra
            q8_copy = fused and mode == "gguf" and types <= INT8_TYPES and n % 16 == 0
            total += n * k + n * (k // GROUP) * 2 if q8_copy else 0
        else:
            total += n * k * elem_bytes
    return total


HEAD_COPY_MAX_BYTES = 128 << 20  #: llmd.quant.prepacked.HEAD_COPY_MAX_BYTES (torch-free here; a test keeps them equal)


def cpu_packs_bf16() -> bool:
    """Whether oneDNN can prepack bfloat16 weights on this CPU (AVX512-BW/VL/DQ; torch-free, from
    ``/proc/cpuinfo``, for estimates: :func:`llmd.quant.prepacked.cpu_supported` probes torch)."""
    return {"avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()


def tied_head_copy_bytes(tensors: dict, elem_bytes: int = 2) -> int:
    """Bytes of the packed copy of a tied LM head's table an engine adds on a CPU that prepacks
    bfloat16 weights (:func:`llmd.quant.prepacked._pack_tied_head`: a model whose head is its
    embedding table, the table within :data:`HEAD_COPY_MAX_BYTES`), else 0. Not part of
    :func:`weight_bytes` (a loaded model's bytes): the engine makes it, after the load."""
    if "output.weight" in tensors or elem_bytes != 2:
        return 0
    emb = tensors["token_embd.weight"]
    n = int(emb.shape[0]) * int(emb.shape[1]) * elem_bytes
    return n if n <= HEAD_COPY_MAX_BYTES else 0
