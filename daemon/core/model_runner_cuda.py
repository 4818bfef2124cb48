"""CUDA set-up of :class:`~llmd.daemon.core.model_runner.ModelRunner`: decode-step CUDA graphs
and the Triton kernels' start-up compilation.

A mixin: the state it reads (``model``, ``caches``, ``layer_caches``, ``layer_group``, ``groups``,
``block_size``, ``device``, ``attention_backend``, ``config``, ``_graph_limits``) is the runner's,
and so are the attributes it sets (``decode_graphs``, ``host_inputs``).
:meth:`CudaMixin.enable_decode_graphs` routes decode-only steps through
:class:`~llmd.daemon.core.cuda_graphs.DecodeGraphs` (padded static inputs, one graph per batch
bucket, captured on CUDA) with a host-side :class:`~llmd.daemon.core.input_batch.InputBatch`
(``host_inputs``) for the padded copies; :meth:`CudaMixin.warm_up_kernels` compiles every
Triton variant the model will launch (:mod:`llmd.kernels.warmup`) before any request and
returns how many.

Errors: :class:`~llmd.daemon.core.errors.LlmdError` (one line) for a failed capture, an int4 KV
cache (decoded eagerly: its K store plans each step on the host) or a variant that fails to compile.
"""

from __future__ import annotations

import torch

from llmd.daemon.core.cuda_graphs import DecodeGraphs
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.input_batch import InputBatch


class CudaMixin:
    """:class:`~llmd.daemon.core.model_runner.ModelRunner`'s CUDA graphs and Triton warm-up;
    reads and sets that class's attributes."""

    def enable_decode_graphs(self, capture: bool) -> int:
        """Route decode-only steps through :class:`DecodeGraphs` (padded static inputs); with
        ``capture`` (CUDA only) capture every bucket's graph now. Returns the graphs captured (0
        without ``capture``: the padded steps then run eagerly, as tests do on CPU).

        Raises:
            LlmdError: a capture failed (one line with CUDA's error), or an int4 KV cache (its K
                store plans each step on the host and its reads need the residual slots).
        """
        if self.caches[0].fmt.k_per_block:
            raise LlmdError("decode steps of an int4 KV cache run eagerly (no CUDA graphs): its K store plans "
                            "each step on the host")
        max_num_seqs, max_model_len = self._graph_limits
        graphs = DecodeGraphs(self.model, self.layer_caches, self.layer_group, len(self.groups), self.block_size,
                              max_num_seqs, max_model_len, self.device, self.attention_backend)
        self.host_inputs = InputBatch(len(self.groups), self.block_size, "cpu", self.attention_backend,
                                      max_num_seqs, max_num_seqs, -(-max_model_len // self.block_size))
        try:
            captured = graphs.capture() if capture else 0
        except RuntimeError as e:
            raise LlmdError(f"CUDA graph capture failed ({e}); --enforce-eager runs without graphs") from None
        self.decode_graphs = graphs
        return captured

    def warm_up_kernels(self, model_dtype: torch.dtype, kv_cache_dtype: str, static_scales: bool,
                        max_model_len: int) -> int:
        """Compile every Triton variant this model will launch by running each once on tiny
        tensors (:mod:`llmd.kernels.warmup`), before any request; returns how many (0 on CPU).

        Raises:
            LlmdError: a variant failed to compile (one line naming it and the device's sm_XY).
        """
        from llmd.kernels.warmup import WarmupSpec, warm_up

        c = self.config
        spec = WarmupSpec(c.head_dim, c.num_heads, c.num_kv_heads, model_dtype, self.block_size, kv_cache_dtype,
                          static_scales, tuple(set(c.layer_windows)), max_model_len)
        try:
            return warm_up(spec, self.device)
        except RuntimeError as e:
            raise LlmdError(str(e)) from None
