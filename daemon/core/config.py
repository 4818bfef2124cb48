"""Engine configuration: one dataclass, validated once, shared by CLI, engine and tests."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llmd.daemon.core.config_quant import (  # noqa: F401 (re-exported)
    ATTENTION_BACKENDS,
    DEFAULT_KV_ROTATION,
    WEIGHT_QUANT_CHOICES,
    QuantConfigMixin,
)
from llmd.daemon.core.errors import LlmdError, require_at_least_one
from llmd.daemon.core.option_values import parse_bytes, parse_kv_scales  # noqa: F401 (re-exported)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DTYPE_CHOICES = ("auto", *DTYPES)
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy values
CONTEXT_OVERFLOW_CHOICES = ("stop", "shift")  # --context-overflow (llama.cpp: --context-shift = shift)
DEFAULT_KV_CACHE_MEMORY_CPU = 512 * 1024**2  # bytes
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
MAX_NUM_SEQS_CPU, MAX_NUM_SEQS_CUDA = 64, 256


@dataclass
class EngineConfig(QuantConfigMixin):
    """Settings of one engine.

    Attributes:
        model: GGUF path or known model name (see ``llmd.models.registry``).
        dtype: "auto" / "float32" / "bfloat16" / "float16"; "auto" (or ``None``) = bfloat16 on
            CUDA, and on CPU bfloat16 when the processor computes it natively (AVX512-BF16 or
            AMX, :func:`cpu_has_native_bf16`), else float32. Resolved to the concrete name.
            "float64" (CPU, torch backend only) is for reference runs such as the
            ``llmd bench kv-quality --dtype float64`` comparison with HF transformers.
        device: "cpu" / "cuda"; ``None`` picks CUDA when available.
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV cache; ``None`` = 512 MiB on CPU, on CUDA what
            ``gpu_memory_utilization`` leaves (:mod:`llmd.daemon.core.gpu_memory`).
        gpu_memory_utilization: fraction (0, 1] of the device's total memory the engine may use
            for weights, activations and KV cache together (vLLM's ``--gpu-memory-utilization``,
            default 0.9); the KV cache gets what is left after the memory already in use and the
            activation estimate. CUDA only; ignored when ``kv_cache_memory`` is given.
        enforce_eager: no CUDA graphs, every step eager (vLLM's ``--enforce-eager``); graphs are
            captured only on CUDA with the triton backend.
        disable_cascade_attn: the cpu backend attends each decode to a prefix it shares with
            others on its own instead of once per group (vLLM's ``--disable-cascade-attn``;
            :mod:`llmd.kernels.cpu_cascade`).
        disable_native_kernels: the cpu backend runs its decodes in torch ops instead of its C
            kernel (:mod:`llmd.kernels.cpu_native`, built with the system C compiler on first
            use); for comparisons, or where no compiler may run.
        max_num_seqs: sequences running at once at most; ``None`` = 256 on CUDA (nano-vllm's
            workload), 64 on CPU (on the 2-core CPU the mixed peer workload ran 1.21x faster than
            at 32, TTFT p50 0.64x, TPOT p50 1.36x).
        max_num_batched_tokens: token budget of one step (tokens); ``None`` = 512 on CPU,
            4096 on CUDA.
        max_model_len: context cap (prompt + output tokens); ``None`` = the model's trained length.
        kv_cache_dtype: "auto" (model dtype), "float16", "bfloat16" (K/V rounded to that 16-bit
            float, no scales; cpu/torch backends), "int8", "fp8_e4m3", "fp8_e5m2", "int4"
            (``llmd.quant.kv``). "auto" on a GGUF model that ``--dtype auto`` put in float32 on a CPU
            (no native bf16) resolves to "float16": llama.cpp's default cache type, half the KV
            bytes (SmolLM2 teacher-forced: ΔNLL -0.0001 %, top-1 100 % vs float32 K/V);
            ``LLMD_FP16_KV=0`` keeps float32, as does an explicit ``--dtype float32``.
        kv_rotation: "none" or "hadamard" (``llmd.quant.rotation``: K after RoPE stored rotated
            by a normalized Walsh-Hadamard matrix, the query too); ``None`` = :data:`DEFAULT_KV_ROTATION`
            of the KV dtype (hadamard for int8, none otherwise).
        kv_scales: static (k_scale, v_scale) per-tensor KV scales; ``None`` = dynamic scales.
        kv_scale_group_size: int8/fp8 only: one dynamic scale per this many consecutive channels
            of a (token, KV head) instead of one per (token, KV head) (0, the default; 32 or 64
            are the measured options, README "Quantized KV cache"); the cpu and torch backends
            read them (the Triton kernels read one scale per (token, KV head) and refuse it).
        attention_backend: "cpu" (the fast batched CPU path) / "torch" (``kernels/reference.py``,
            the pure-torch oracle) / "triton"; ``None`` = triton on CUDA, cpu on CPU (torch with
            ``dtype="float64"``). Triton on CPU needs ``TRITON_INTERPRET=1`` (the interpreter,
            for tests).
        disable_hybrid_kv_cache_manager: put every layer in one full-attention KV cache group,
            so sliding-window layers keep every block (vLLM's flag of the same name; for
            comparisons). Default False: sliding-window layers free out-of-window blocks.
        enable_prefix_caching: reuse the KV of cached full blocks across requests (default on;
            ``--no-prefix-caching``).
        prefix_cache_seed: seed of the block-hash chain root; ``None`` = random per daemon.
        max_prefill_chunk: prefill tokens of one request per step (tokens); ``None`` = the
            token budget (512 on CPU; on CUDA the 4,096 budget, vLLM's range being 2,048-8,192).
        max_num_waiting: waiting requests at most before new ones get HTTP 429 (default 1,024).
        scheduling_policy: "fcfs" (default: arrival order; a request with a non-zero
            ``priority`` is refused) or "priority" (lower ``priority`` first, FCFS among equals;
            the largest value is preempted first) — vLLM's ``--scheduling-policy`` and values.
        weight_quant: "auto" / "none" / "gguf" / "int8" / "nf4" / "fp4" (``llmd.models.weight_quant``).
            "nf4" / "fp4" (CPU and CUDA) and "int8" on CUDA run through bitsandbytes and need it
            importable (checked here, before any weights load; on CUDA they also set
            ``enforce_eager``: LLM.int8()'s outlier split reads its columns on the host, which a CUDA
            graph cannot capture, and the 4-bit kernels' capture has not run on a GPU here);
            "gguf" and "auto"'s packs are CPU only; "int8" on a CPU is int8 per 32 columns
            (``llmd.quant.int8_groups``). "gguf" keeps
            the file's 4-bit blocks as int4 packs (Q8_0 as per-row int8) and drops the dense
            weights; "auto" (the default) = on a bfloat16 CPU model the same packs for steps of
            at most 4 tokens plus the dense weights for larger ones (one stream decodes from ~4×
            fewer bytes, batches keep the bfloat16 GEMM); on a CPU model that is float32 by
            ``--dtype auto`` (no native bfloat16; an explicit float32 stays dense) and whose batch-1
            steps the fused C kernel can run (:meth:`wants_fused_decode`; e.g. an AVX2-only CPU,
            where float32 is the dtype) the packs for that kernel with the dense float32 weights
            for every other step (torch's int4 kernel is ~30× slower on float32 activations);
            else "none". On such a float32-by-auto GGUF model the dense float32 products of every
            step also run on float16 copies of the weights (``fp16_weights``, not a field:
            :mod:`llmd.quant.fp16_linear`, fbgemm's fp16 GEMM; ``LLMD_FP16_WEIGHTS=0`` turns it off).
        context_overflow: what a sequence reaching ``max_model_len`` does: "stop" (default:
            ``finish_reason`` "length", and prompt + ``max_tokens`` beyond the context is refused)
            or "shift" (llama.cpp's ``--context-shift``: keep the first ``keep`` tokens, discard
            the oldest half of the rest in whole blocks, re-rotate the kept keys and go on;
            :mod:`llmd.daemon.core.context_shift`). A request's ``context_overflow`` overrides it.
        keep: tokens a shift keeps at the head (llama.cpp's ``--keep``; rounded up to whole
            blocks, at least the first block: the attention sink,
            :func:`llmd.daemon.core.context_shift.keep_blocks`; -1 = the whole prompt); a
            request's ``n_keep`` overrides it.
        threads: torch intra-op threads, set when the engine is built
            (``torch.set_num_threads``); ``None`` = ``$OMP_NUM_THREADS`` if set, else the cores
            this process may use (``len(os.sched_getaffinity(0))``), and then on a CPU fewer
            while other processes keep some of those cores busy
            (:mod:`llmd.daemon.core.thread_governor`).
    """

    model: str = "smollm2-135m"
    dtype: str | None = None
    device: str | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enforce_eager: bool = False
    disable_cascade_attn: bool = False
    disable_native_kernels: bool = False
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[float, float] | None = None
    kv_rotation: str | None = None
    kv_scale_group_size: int = 0
    attention_backend: str | None = None
    disable_hybrid_kv_cache_manager: bool = False
    enable_prefix_caching: bool = True
    prefix_cache_seed: int | None = None
    max_prefill_chunk: int | None = None
    max_num_waiting: int = 1024
    scheduling_policy: str = "fcfs"
    threads: int | None = None
    weight_quant: str = "auto"
    context_overflow: str = "stop"
    keep: int = 0

    def resolve(self) -> "EngineConfig":
        """Fill device-dependent defaults and validate. Raises LlmdError naming the bad setting."""
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise LlmdError(f"--device must be cpu or cuda, got {self.device!r}")
        on_cuda = self.device.startswith("cuda")
        if on_cuda and not torch.cuda.is_available():
            raise LlmdError("--device cuda requested but no CUDA device is available")
        if self.dtype is None or self.dtype == "auto":
            self.dtype = "bfloat16" if on_cuda or cpu_has_native_bf16() else "float32"
            self.dtype_auto = True  # not a dataclass field (asdict/replace round-trips stay valid)
        if self.dtype not in DTYPES:
            raise LlmdError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.threads is None:
            self.threads = default_threads()
            # neither --threads nor $OMP_NUM_THREADS: the CPU engine adapts (daemon/core/thread_governor.py)
            self.threads_auto = not os.environ.get("OMP_NUM_THREADS", "").strip()
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise LlmdError(f"--threads must be an integer >= 1, got {self.threads!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 4096 if on_cuda else 512
        if self.max_prefill_chunk is None:
            self.max_prefill_chunk = self.max_num_batched_tokens
        if self.max_num_seqs is None:
            self.max_num_seqs = MAX_NUM_SEQS_CUDA if on_cuda else MAX_NUM_SEQS_CPU
        if not 0 < self.gpu_memory_utilization <= 1:
            raise LlmdError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        require_at_least_one(**{name: getattr(self, name) for name in (
            "block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "max_num_waiting")})
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise LlmdError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                            f"got {self.scheduling_policy!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise LlmdError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise LlmdError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.context_overflow not in CONTEXT_OVERFLOW_CHOICES:
            raise LlmdError(f"--context-overflow must be one of {', '.join(CONTEXT_OVERFLOW_CHOICES)}, "
                            f"got {self.context_overflow!r}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < -1:
            raise LlmdError(f"--keep must be -1 (the whole prompt) or a token count >= 0, got {self.keep!r}")
        self._resolve_kv_and_backend(on_cuda)
        self._resolve_weight_quant(on_cuda)
        if self.dtype == "float64" and (on_cuda or self.attention_backend != "torch"):
            raise LlmdError("--dtype float64 is for CPU reference runs: it needs --device cpu and "
                            "--attention-backend torch")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        """The resolved dtype (call :meth:`resolve` first: "auto" / ``None`` read as float32)."""
        return DTYPES.get(self.dtype or "float32", torch.float32)

    def apply_threads(self) -> None:
        """Set torch's intra-op threads to :attr:`threads` (resolved), and its inter-op pool
        to the same when that pool has not started yet (torch allows it once per process)."""
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if torch.get_num_interop_threads() > self.threads:
            try:
                torch.set_num_interop_threads(self.threads)
            except RuntimeError:  # already set, or inter-op work already started: leave it
                pass


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX tiles), so oneDNN's
    bfloat16 matmuls beat float32. Not ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: that
    is true on any AVX512BW CPU, where bfloat16 is emulated and slower."""
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    for probe in probes:
        try:
            if probe is not None and probe():
                return True
        except Exception:  # a torch build without the probe's backend
            continue
    return False


def default_threads() -> int:
    """``$OMP_NUM_THREADS`` when it is a positive integer, else the cores this process may run on."""
    import os

    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)
