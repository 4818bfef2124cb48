"""Building an :class:`~llmd.daemon.core.engine.Engine`: the checks, sizes and loads before its first step.

* :func:`resolve_for_model` settles the :class:`EngineConfig` against an already loaded model
  (``--dtype auto`` is the model's dtype) and applies ``--threads``;
* :func:`check_backends` (:func:`check_triton_backend`, :func:`check_kv_layout`) refuses a
  model/cache combination the kernels or the KV format cannot run, with one line naming the
  setting (LlmdError);
* :func:`size_kv_cache` turns ``--kv-cache-memory`` (or the device's default share) into the
  pool's blocks (:class:`KVCacheSize`, bytes and blocks);
* :func:`make_kv_manager`, :func:`make_runner` build the block bookkeeping and the model
  runner from the config;
* :func:`from_config` resolves ``--model`` and loads the weights and tokenizer
  (:func:`load_model_and_tokenizer`) into a new engine (:meth:`Engine.from_config
  <llmd.daemon.core.engine.Engine.from_config>`);
* :func:`float16_warning`, :func:`make_thread_governor`: the rest of the
  engine's startup.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from llmd.daemon.core.config import DEFAULT_KV_CACHE_MEMORY_CPU, DTYPES, EngineConfig
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.gpu_memory import activation_bytes, cuda_kv_cache_bytes
from llmd.daemon.core.kv_size import check_kv_cache_memory, kv_cache_bytes_per_token, residual_slots
from llmd.daemon.core.model_runner import ModelRunner
from llmd.daemon.kv import KVCacheManager
from llmd.kernels.launch import check_triton_config
from llmd.models.config import ModelConfig
from llmd.quant import fp16_linear
from llmd.quant.kv import KVCacheFormat, get_format
from llmd.quant.rotation import check_rotation

#: architectures whose activations overflow float16 (vLLM's ``_FLOAT16_NOT_SUPPORTED_MODELS``)
FLOAT16_OVERFLOWS = ("gemma2", "gemma3")


def float16_warning(architecture: str, dtype: str) -> str | None:
    """The startup warning for a model known to overflow float16, or None."""
    if dtype == "float16" and architecture in FLOAT16_OVERFLOWS:
        return (f"{architecture} is known to overflow float16 (inf/NaN logits end requests with finish_reason "
                "'error'); use --dtype bfloat16 or float32")
    return None


def num_kv_blocks(memory: int, block_size: int, block_bytes: int) -> int:
    """``floor(memory / block_bytes)``; raises LlmdError below 2 blocks."""
    n = memory // block_bytes
    if n < 2:
        raise LlmdError(f"--kv-cache-memory {memory} B holds {n} blocks of {block_size} tokens; need at least 2")
    return n


def check_triton_backend(cfg: ModelConfig, model_dtype: torch.dtype, block_size: int, kv_cache_dtype: str) -> None:
    """Refuse a model/cache combination the Triton kernels cannot run, at engine configuration
    (before the first launch): one line naming the setting. Raises LlmdError."""
    try:
        check_triton_config(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, model_dtype, block_size, kv_cache_dtype)
    except ValueError as e:
        raise LlmdError(str(e)) from None


def check_kv_layout(cfg: ModelConfig, kv_cache_dtype: "str | KVCacheFormat", kv_rotation: str) -> None:
    """Refuse a head_dim the KV format's scale groups or the rotation cannot take (int4 and
    ``--kv-scale-group-size``: a multiple of the group; hadamard: a power of two), with one line.
    Raises LlmdError."""
    try:
        get_format(kv_cache_dtype).check_head_dim(cfg.head_dim)
        check_rotation(kv_rotation, cfg.head_dim)
    except ValueError as e:
        raise LlmdError(str(e)) from None


def check_backends(config: EngineConfig, cfg: ModelConfig, model_dtype: torch.dtype) -> None:
    """The checks of :func:`check_triton_backend` (``--attention-backend triton`` only) and
    :func:`check_kv_layout` for the resolved ``config``. Raises LlmdError."""
    if config.attention_backend == "triton":
        check_triton_backend(cfg, model_dtype, config.block_size, config.kv_cache_dtype)
    check_kv_layout(cfg, config.kv_format, config.kv_rotation)


def resolve_for_model(config: EngineConfig, model) -> EngineConfig:
    """``config.resolve()`` for a model loaded already: without an explicit ``--dtype``, the
    dtype is the model's (``dtype_auto`` off). Applies ``--threads`` (``torch.set_num_threads``,
    once per engine). Returns ``config``, resolved in place."""
    dtype_given = config.dtype not in (None, "auto")
    config.resolve()
    model_dtype = next(model.parameters()).dtype
    loaded = next((k for k, v in DTYPES.items() if v == model_dtype), config.dtype)
    if not dtype_given and loaded != config.dtype:  # a model loaded already: "auto" is its dtype
        config.dtype, config.dtype_auto = loaded, False
    config.apply_threads()
    return config


def make_thread_governor(config: EngineConfig):
    """A :class:`~llmd.daemon.core.thread_governor.ThreadGovernor` (fewer threads while other
    processes keep our cores busy) for a CPU engine whose thread count was not given, unless
    ``LLMD_ADAPTIVE_THREADS=0``; else None."""
    if config.device == "cpu" and getattr(config, "threads_auto", False) and config.threads > 1 \
            and os.environ.get("LLMD_ADAPTIVE_THREADS", "1") != "0":
        from llmd.daemon.core.thread_governor import ThreadGovernor

        return ThreadGovernor(config.threads)
    return None


@dataclasses.dataclass(frozen=True)
class KVCacheSize:
    """The KV pool of one engine (bytes, blocks of ``block_size`` tokens over every layer)."""

    memory: int  # --kv-cache-memory, or the device's default share (B)
    num_blocks: int
    block_bytes: int  # one block of every KV cache group and layer (B)
    bytes_per_token: int  # int4: with the residual's share of the pool spread over its tokens
    residual_bytes: int  # int4's 16-bit open-block K residual (B); 0 for other formats
    num_residual_slots: int  # its slots (one per open block of --max-num-seqs sequences); 0 without


def size_kv_cache(config: EngineConfig, cfg: ModelConfig, kv_dtype: torch.dtype, groups) -> KVCacheSize:
    """Size the pool of the resolved ``config`` for a model of ``cfg`` in ``kv_dtype`` over the
    KV cache ``groups``: ``--kv-cache-memory``, else ``--gpu-memory-utilization`` of a CUDA
    device less the activations' peak, else the CPU default. Raises LlmdError when it holds
    fewer than 2 blocks (int4: beside its open-block residual)."""
    fmt = config.kv_format
    bytes_per_token = kv_cache_bytes_per_token(cfg, fmt, kv_dtype)
    memory = config.kv_cache_memory
    if memory is None:
        if config.device.startswith("cuda"):  # --gpu-memory-utilization of the device's total
            free, total = torch.cuda.mem_get_info(torch.device(config.device))
            graphs = not config.enforce_eager and not fmt.k_per_block  # int4 decodes run eager
            act = activation_bytes(cfg, config.max_num_batched_tokens, config.max_num_seqs, kv_dtype.itemsize, graphs)
            memory = cuda_kv_cache_bytes(config.gpu_memory_utilization, total, free, act)
        else:
            memory = DEFAULT_KV_CACHE_MEMORY_CPU
    num_residual = residual_slots(groups, config.max_num_seqs) if fmt.k_per_block else 0
    block_bytes, residual_bytes = check_kv_cache_memory(config, cfg, groups, kv_dtype, memory)
    num_blocks = num_kv_blocks(memory - residual_bytes, config.block_size, block_bytes)
    if residual_bytes:  # int4: the residual's share of the pool, spread over its tokens
        bytes_per_token = round(bytes_per_token * (1 + residual_bytes / (num_blocks * block_bytes)))
    return KVCacheSize(memory, num_blocks, block_bytes, bytes_per_token, residual_bytes, num_residual)


def make_kv_manager(config: EngineConfig, cfg: ModelConfig, size: KVCacheSize, groups) -> KVCacheManager:
    """The block bookkeeping of a pool of ``size``; its prefix-cache hashes keyed by the model
    and the KV format (a cached block of another model or format never matches)."""
    fmt = config.kv_format
    return KVCacheManager(
        size.num_blocks, config.block_size, groups, enable_caching=config.enable_prefix_caching,
        prefix_cache_seed=config.prefix_cache_seed, model_id=f"{cfg.name}|{cfg.architecture}|{config.dtype}",
        kv_cache_dtype=f"{fmt.scheme}|{config.kv_scales}|{config.kv_rotation}",
        num_residual_slots=size.num_residual_slots,
    )


def make_runner(model, config: EngineConfig, model_dtype: torch.dtype, size: KVCacheSize, groups,
                max_model_len: int) -> ModelRunner:
    """The :class:`ModelRunner` of ``model`` over a KV cache of ``size``, as ``config`` sets it up
    (backend, CUDA graphs, rotation, cascade attention, native kernels, fp16 weight packs)."""
    c = config
    return ModelRunner(
        model, size.num_blocks, c.block_size, model_dtype, c.device, c.kv_format, c.kv_scales, c.attention_backend,
        groups, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=max_model_len, cuda_graphs=not c.enforce_eager, kv_rotation=c.kv_rotation,
        residual_slots=size.num_residual_slots, cascade_attn=not c.disable_cascade_attn,
        native_kernels=not c.disable_native_kernels, fp16_weights=getattr(c, "fp16_weights", False),
    )


def load_model_and_tokenizer(config: EngineConfig) -> tuple:
    """Resolve ``config.model`` (resolved, threads applied) and load it: a ``random:`` preset
    (:mod:`llmd.models.presets`, no GGUF), else the GGUF's weights (``--weight-quant``, the
    weights cache) and tokenizer. Returns ``(model, tokenizer)``.

    Raises:
        LlmdError: unknown model, bad GGUF, bad setting.
    """
    if config.model.startswith("random:"):  # a random-weight preset: no GGUF, no gguf (llmd.models.presets)
        from llmd.models.presets import load_random_model

        model, _, tokenizer = load_random_model(config.model, config.torch_dtype, config.device)
        return model, tokenizer
    from llmd.models import weights_cache
    from llmd.models.gguf_loader import load_model
    from llmd.models.header_cache import header_info
    from llmd.models.registry import resolve_model
    from llmd.models.tokenizer import load_tokenizer

    path = resolve_model(config.model)
    fused = config.settle_weight_quant(header_info(path).config)
    model, cfg = load_model(path, config.torch_dtype, config.device, config.weight_quant, config.keep_dense,
                            weights_cache=weights_cache.enabled(),  # a warm start maps the converted weights
                            native=fused)
    return model, load_tokenizer(path, cfg, header_info(path).data_offset)


def from_config(cls, config: EngineConfig):
    """An engine of class ``cls`` (:class:`~llmd.daemon.core.engine.Engine`) with the model and
    tokenizer of ``config`` (:func:`load_model_and_tokenizer`); a GGUF model's float32 weight
    pages that fp16 packs replaced are handed back (``released_dense_bytes``).

    Raises:
        LlmdError: unknown model, bad GGUF, bad setting.
    """
    config.resolve()
    config.apply_threads()  # the weight dequantization runs on these threads too
    model, tokenizer = load_model_and_tokenizer(config)
    engine = cls(model, tokenizer, config)
    # this engine owns a GGUF model (not a random: preset): the packs replace its float32 weights
    if engine.runner.fp16_weights and not config.model.startswith("random:"):
        engine.released_dense_bytes = fp16_linear.release_dense_pages(model)
    return engine
