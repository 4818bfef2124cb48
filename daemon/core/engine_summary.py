"""The engine's startup lines: :meth:`~SummaryMixin.runtime_summary` (dtype, attention
backend and the kernels that serve it, threads, weight packs) and
:meth:`~SummaryMixin.capacity_summary` (the KV cache: bytes per token, blocks, groups, how many
full-context sequences fit), as ``llmd serve``, ``llmd status`` and the benchmarks print them.

:class:`SummaryMixin` is a base of :class:`~llmd.daemon.core.engine.Engine`; it reads the
engine's ``config``, ``model_config``, ``runner``, ``kv_manager``, ``kv_cache_groups``,
``thread_governor`` and its KV sizes (``bytes_per_token``, ``num_blocks``, ``block_bytes``,
``residual_bytes``, ``kv_cache_memory``, bytes; ``released_dense_bytes``).
"""

from __future__ import annotations

import torch

from llmd.daemon.core.kv_size import group_summary, kv_cache_block_bytes
from llmd.daemon.protocol import fmt_bytes
from llmd.quant import fp16_linear, prepacked


def glue_ops(model) -> str:
    """The layer ops of ``model`` that llmd's C glue runs (kernels/cpu_glue.py) for the startup
    line: RoPE always; RMSNorm unless it is Gemma's float32 one (``GemmaRMSNorm``, torch's);
    SwiGLU when every MLP is SiLU-gated (Gemma's GeLU-tanh stays torch's)."""
    from llmd.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm

    mods = list(model.modules())
    ops = ["norms"] if any(type(m) is RMSNorm for m in mods) and not any(isinstance(m, GemmaRMSNorm) for m in mods) \
        else []
    ops.append("RoPE")
    mlps = [m for m in mods if isinstance(m, GatedMLP)]
    if mlps and all(m.act is torch.nn.functional.silu for m in mlps):
        ops.append("SwiGLU")
    return ", ".join(ops)


class SummaryMixin:
    """The startup lines of :class:`~llmd.daemon.core.engine.Engine` (see the module docstring)."""

    def capacity_summary(self) -> str:
        """One line: bytes/token, blocks, KV cache groups, and how many full-context sequences fit."""
        from llmd.daemon.core.kv_size import blocks_per_sequence

        bs = self.config.block_size
        per_seq = blocks_per_sequence(self.kv_cache_groups, self.max_model_len, bs, 1)
        return (
            f"KV cache: {self.bytes_per_token} B/token ({self._kv_dtype_label()}), {self.num_blocks} blocks of "
            f"{bs} tokens x {max(len(g.layer_ids) for g in self.kv_cache_groups)} layers "
            f"({fmt_bytes(self.kv_cache_memory)}); {group_summary(self.kv_cache_groups, bs)}; "
            f"{(self.num_blocks - 1) / per_seq:.2f} sequences of {self.max_model_len} tokens"
        )

    def runtime_summary(self) -> str:
        """The chosen dtype, attention backend and torch threads, e.g.
        ``dtype bfloat16 (auto: native bf16 on this CPU), attention cpu, 2 threads``."""
        from llmd.daemon.core.config import cpu_has_native_bf16

        c = self.config
        why = ""
        if getattr(c, "dtype_auto", False):
            on_cuda = c.device.startswith("cuda")
            why = " (auto: CUDA)" if on_cuda else (" (auto: native bf16 on this CPU)" if cpu_has_native_bf16()
                                                   else " (auto: no native bf16 on this CPU)")
        threads = f"{c.threads} thread{'' if c.threads == 1 else 's'}"
        if self.thread_governor is not None:
            threads += " (fewer while other processes keep cores busy)"
        wq = getattr(self.runner.model, "weight_quant_summary", None)
        weights = f", {wq.describe()}" if wq is not None and wq.mode != "none" else ""
        attn = c.attention_backend
        if attn == "cpu":  # who runs the decodes (kernels/cpu_native.py), and why not the C kernel
            from llmd.kernels import cpu_native
            from llmd.kernels.cpu_attention import compute_dtype_for
            from llmd.kernels.native import build

            mc = self.model_config
            limit = cpu_native.unserved_reason(c.kv_format, compute_dtype_for(c.torch_dtype), c.block_size,
                                               mc.head_dim, mc.num_heads // mc.num_kv_heads)
            reason = ("--disable-native-kernels" if c.disable_native_kernels else build.why_not or limit
                      or "not for this model dtype, KV format, block size or shape")
            attn += " (decodes: C kernel" if self.runner.native_decodes else f" (decodes: torch ops, {reason}"
            if self.runner.native_decodes and self.runner.amx_scores:
                attn += ", scores on AMX tiles"
            elif self.runner.native_decodes and self.runner.dot_scores:
                attn += ", scores by VDPBF16PS"
            if self.runner.fused_decode is not None:  # kernels/cpu_fused.py: the whole batch-1 step in C
                attn += "; batch-1 steps: fused C kernel"
            elif c.weight_quant == "gguf":
                attn += f"; batch-1 steps: torch ops, {self.runner.fused_why_not}"
            if self.runner.native_glue:  # kernels/cpu_glue.py; models/glue_forward.py fuses them across ops
                from llmd.models import glue_forward

                fused = glue_forward.why_not(self.runner.model, self.runner.layer_caches, check_active=False) is None
                if fused or c.dtype == "bfloat16":  # a float32 model's glue exists only fused (layer_glue_f32.h)
                    attn += f"; {glue_ops(self.runner.model)}: C" + (", fused across ops" if fused else "")
            attn += ")"
        packed = prepacked.packed_count(self.runner.model)
        copy = prepacked.head_copy_bytes(self.runner.model)
        head = f" (the tied LM head's as a copy, +{copy / 2**20:.0f} MiB)" if copy else ""
        amx = prepacked.amx_count(self.runner.model)
        tiles = f"for {prepacked.tile_kernel}"  # set by the kernel whose install packed them
        kind = tiles if amx == packed else f"({amx} {tiles}, {packed - amx} for oneDNN)" if amx else "for oneDNN"
        linears = f", linears: {packed} bf16 weights prepacked {kind}{head}" if packed else ""
        fp16, fp16_bytes = fp16_linear.packed_count(self.runner.model)
        if fp16 and self.runner.fp16_weights:
            released = self.released_dense_bytes
            gone = f"; their float32 pages, {released / 2**20:.0f} MiB, handed back (MADV_PAGEOUT)" if released else ""
            linears += f", linears: {fp16} float32 weights as fp16 for fbgemm (+{fp16_bytes / 2**20:.0f} MiB{gone})"
        return f"dtype {c.dtype}{why}, attention {attn}, {threads}{linears}{weights}"

    def _kv_dtype_label(self) -> str:
        c = self.config
        if c.kv_cache_dtype == "auto":
            return c.dtype
        fmt = c.kv_format
        if not fmt.quantized:  # float16 / bfloat16: no scales
            return f"{c.kv_cache_dtype}, {c.dtype} model"
        scales = (f"static scales k={c.kv_scales[0]:g}, v={c.kv_scales[1]:g}" if c.kv_scales
                  else f"dynamic {str(fmt.scale_dtype).removeprefix('torch.')} scales")
        if fmt.k_per_block:
            scales = (f"K per channel over each {c.block_size}-token block (float16 scale + zero point), "
                      f"V per {fmt.group_size} channels; open blocks' K in a 16-bit residual "
                      f"({self.residual_bytes / 2**20:.1f} MiB, {self.kv_manager.num_residual_slots} slots)")
        elif fmt.group_size:
            scales += f" per {fmt.group_size} channels"
        rotation = "" if c.kv_rotation == "none" else f", {c.kv_rotation} rotation"
        full = kv_cache_block_bytes(self.model_config, self.kv_cache_groups, c.block_size, "auto", torch.bfloat16)
        multiple = (self.num_blocks / max(1, self.kv_cache_memory // full) if fmt.k_per_block
                    else full / self.block_bytes)
        return (f"{c.kv_cache_dtype} + {scales}{rotation}, {multiple:.2f}x the blocks of "
                f"16-bit; attention {c.attention_backend}")
