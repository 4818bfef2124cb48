"""The KV cache's share of a CUDA device under ``--gpu-memory-utilization`` (vLLM's name and meaning).

vLLM: the engine may use ``gpu_memory_utilization × total`` bytes for weights, activations and
KV cache together; it profiles a forward pass for the activation peak and gives the KV cache
the rest. llmd estimates the activation peak from the shapes instead (:func:`activation_bytes`:
no profiling pass, so start-up does not run a max-size step), and counts everything already in
use on the device (this process's weights and CUDA context, and other processes' memory) against
the budget, so it never over-commits a shared GPU:

``kv = utilization × total − (total − free) − activation_bytes``
"""

from __future__ import annotations

from llmd.daemon.core.errors import LlmdError
from llmd.models.config import ModelConfig

#: float32 logits rows alive at once in the sampler (logits, probabilities, a sorted copy)
LOGIT_COPIES = 3
#: headroom over the per-token sum (a layer's input and output alive together, allocator slack)
ACTIVATION_HEADROOM = 2
MAX_DECODE_SPLITS = 64  # llmd.kernels.decode_attention.num_decode_splits' cap


def activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int,
                     cuda_graphs: bool = True) -> int:
    """Estimated peak transient memory of one step (bytes).

    * per token of the token budget: hidden states (residual, normed, attention and MLP outputs:
      4 × hidden), Q/K/V ((heads + 2 × kv_heads) × head_dim), the attention output (heads ×
      head_dim), gate/up and the activation (3 × ffn), RoPE tables (2 × head_dim), in the model
      dtype, × :data:`ACTIVATION_HEADROOM`;
    * the sampler: ``max_num_seqs × vocab`` float32 × :data:`LOGIT_COPIES`;
    * the decode kernel's split partials: ``max_num_seqs × heads × 64 × (head_dim + 2)`` float32;
    * with CUDA graphs, their pool: the largest bucket's activations and partials once more.
    """
    per_token = (4 * cfg.hidden_size + (2 * cfg.num_heads + 2 * cfg.num_kv_heads + 2) * cfg.head_dim
                 + 3 * cfg.intermediate_size) * dtype_bytes * ACTIVATION_HEADROOM
    partials = max_num_seqs * cfg.num_heads * MAX_DECODE_SPLITS * (cfg.head_dim + 2) * 4
    total = per_token * max_num_batched_tokens + max_num_seqs * cfg.vocab_size * 4 * LOGIT_COPIES + partials
    if cuda_graphs:
        total += per_token * max_num_seqs + partials
    return total


def cuda_kv_cache_bytes(utilization: float, total: int, free: int, activations: int) -> int:
    """KV cache bytes: ``utilization × total − (total − free) − activations``.

    Args:
        utilization: ``--gpu-memory-utilization``, in (0, 1].
        total, free: the device's memory (bytes, ``torch.cuda.mem_get_info()`` after the weights loaded).
        activations: :func:`activation_bytes`.
    Raises:
        LlmdError: nothing is left for the KV cache (the line names the numbers and the fix).
    """
    used = total - free
    kv = int(utilization * total) - used - activations
    if kv <= 0:
        gib = 2**30
        raise LlmdError(f"--gpu-memory-utilization {utilization} leaves no KV cache: {utilization * total / gib:.2f} "
                        f"GiB allowed, {used / gib:.2f} GiB in use (weights, CUDA context, other processes), "
                        f"{activations / gib:.2f} GiB of activations estimated; raise it, or lower "
                        "--max-num-seqs / --max-num-batched-tokens")
    return kv
