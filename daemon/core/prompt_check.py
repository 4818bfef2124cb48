"""A prompt's length rules before the weights load (``llmd generate``).

A one-shot command that loads ~100 MB-1 GB of weights only to refuse its prompt wastes the
load (3-30 s on a CPU): :func:`check_prompt_before_load` reads what the rules need — the GGUF
header (cached, :mod:`llmd.models.header_cache`) and the tokenizer (cached,
:mod:`llmd.models.tokenizer`), no weights — and applies the same
:class:`~llmd.daemon.core.input_processor.InputProcessor` the engine's ``add_request`` applies.
What depends on the KV pool (a request that can never fit in it) is still checked by the
engine, after the load. :func:`check_options_before_load` does the same for the engine options
whose limits need the model's header (``--keep``, ``--kv-cache-memory``), for every command that
builds an engine.
"""

from __future__ import annotations

import copy

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.input_processor import InputProcessor, Prompt, check_keep_option, model_context
from llmd.daemon.core.request import SamplingParams


def check_prompt_before_load(config: EngineConfig, prompt: Prompt, params: SamplingParams) -> None:
    """Refuse ``prompt`` with ``params`` as the engine built from ``config`` would, without
    loading the weights. ``params`` is not changed (the rules run on a copy). Random-weight
    presets (``random:...``) have no GGUF and are left to the engine.

    Raises:
        RequestError: an empty prompt, one that leaves no room to generate, or prompt +
            ``max_tokens`` beyond the context (:meth:`InputProcessor.process`).
        LlmdError: unknown model, unreadable GGUF or unsupported architecture, chat messages for a
            model without a template.
    """
    if config.model.startswith("random:"):
        return
    from llmd.models.header_cache import header_info
    from llmd.models.registry import layer_tensors, resolve_model
    from llmd.models.tokenizer import load_tokenizer

    path = resolve_model(config.model)
    info = header_info(path)
    cfg = info.config
    layer_tensors(cfg.architecture)  # an architecture llmd cannot run fails as the load would
    tokenizer = load_tokenizer(path, cfg, info.data_offset)
    processor = InputProcessor(tokenizer, cfg.vocab_size, model_context(config.max_model_len, cfg.max_position),
                               config.context_overflow, config.keep, config.block_size)
    processor.process(prompt, copy.copy(params))


def check_options_before_load(config: EngineConfig) -> None:
    """Refuse a resolved ``config`` whose ``--keep`` leaves no block of the context to discard,
    or whose ``--kv-cache-memory`` holds fewer than 2 KV blocks, as the engine would after
    loading the weights, from the model's header alone (a ``random:`` preset's config).

    Raises:
        LlmdError: that ``--keep`` or ``--kv-cache-memory`` (the engine's words), or an unknown /
            unreadable model.
    """
    if config.keep <= 0 and config.kv_cache_memory is None:  # nothing whose limit is in the model
        return
    from llmd.models.header_cache import model_config

    cfg = model_config(config.model)
    if config.keep > 0:  # 0 and -1 (the prompt) always fit
        check_keep_option(config.keep, model_context(config.max_model_len, cfg.max_position), config.block_size)
    if config.kv_cache_memory is not None:  # the default share is the engine's to size (CUDA: the free memory)
        from llmd.daemon.core.engine_setup import check_kv_layout
        from llmd.daemon.core.kv_size import check_kv_cache_memory
        from llmd.daemon.kv import make_kv_cache_groups

        check_kv_layout(cfg, config.kv_format, config.kv_rotation)  # the engine's order: the layout first
        groups = make_kv_cache_groups(cfg.layer_windows, hybrid=not config.disable_hybrid_kv_cache_manager)
        check_kv_cache_memory(config, cfg, groups, config.dtype, config.kv_cache_memory)
