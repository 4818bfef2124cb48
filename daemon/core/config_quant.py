"""The KV-cache, attention-backend and weight-quantization settings of :class:`~llmd.daemon.core.config.EngineConfig`.

Their validation and the resolution of their "auto" values (called by ``EngineConfig.resolve``),
and the weight-pack decisions that follow from them (the fused single-stream decode kernel's
packs, dense weights kept beside the packs). A mixin: the fields and their documentation are
``EngineConfig``'s; "the class docstring" below means that one.
"""

from __future__ import annotations

from llmd.daemon.core.errors import LlmdError
from llmd.quant.kv_format import KVCacheFormat, get_format

ATTENTION_BACKENDS = ("cpu", "torch", "triton")
WEIGHT_QUANT_CHOICES = ("auto", "none", "gguf", "int8", "nf4", "fp4")  # llmd.models.weight_quant modes, and auto
#: --kv-rotation when not given, per --kv-cache-dtype (README "Quantized KV cache": measured wins)
DEFAULT_KV_ROTATION = {"int8": "hadamard"}  # int4 (KIVI K per channel): none measured better (README)


class QuantConfigMixin:
    """:class:`~llmd.daemon.core.config.EngineConfig`'s KV-cache, attention-backend and
    weight-quant resolution; reads and sets that dataclass's fields."""

    def _gguf_float32_by_auto(self, on_cuda: bool) -> bool:
        """A GGUF model that ``--dtype auto`` put in float32 on a CPU (no native bf16; not an
        explicit ``--dtype float32``, which keeps exact float32): the models that get the fp16
        weight packs, the fused kernel's packs only, and a float16 KV cache for ``auto``."""
        return (not on_cuda and self.dtype == "float32" and getattr(self, "dtype_auto", False)
                and not self.model.startswith("random:"))

    def _resolve_weight_quant(self, on_cuda: bool) -> None:
        """Validate --weight-quant and resolve "auto" (see the class docstring)."""
        if self.weight_quant not in WEIGHT_QUANT_CHOICES:
            raise LlmdError(f"--weight-quant must be one of {', '.join(WEIGHT_QUANT_CHOICES)}, "
                            f"got {self.weight_quant!r}")
        if self.weight_quant == "auto":
            gguf_model = not self.model.startswith("random:")
            # float32 because the CPU has no native bf16 (not an explicit --dtype float32, which keeps
            # every step on the dense float32 weights: exact tokens); kept if the fused kernel serves it
            fused_only = self._gguf_float32_by_auto(on_cuda)
            self.weight_quant = "gguf" if gguf_model and not on_cuda and self.dtype == "bfloat16" or fused_only \
                else "none"
            self.keep_dense_weights = True  # not a dataclass field, as dtype_auto
            self.packs_for_fused_only = fused_only  # Engine.from_config: "none" unless the fused kernel runs
            # the same float32-by-auto CPU model's dense products on fp16 weights (quant/fp16_linear.py)
            self.fp16_weights = fused_only
        elif self.weight_quant != "none":
            bnb = self.weight_quant in ("nf4", "fp4") or (self.weight_quant == "int8" and on_cuda)
            if on_cuda and not bnb:
                raise LlmdError(f"--weight-quant {self.weight_quant} runs on CPU only (torch's CPU weight-only "
                                "kernels); on CUDA use none, int8 or nf4 (bitsandbytes)")
            if self.dtype not in ("bfloat16", "float32"):
                raise LlmdError(f"--weight-quant {self.weight_quant} needs --dtype bfloat16 or float32, "
                                f"got {self.dtype}")
            if self.model.startswith("random:"):
                raise LlmdError(f"--weight-quant {self.weight_quant} packs a GGUF file's weights; "
                                f"{self.model} has none (use none)")
            if bnb:
                from llmd.quant.bnb import BNB_REQUIREMENT, bitsandbytes_available

                if not bitsandbytes_available():
                    where = " on CUDA" if self.weight_quant == "int8" else ""
                    raise LlmdError(f"--weight-quant {self.weight_quant}{where} needs bitsandbytes, which is not "
                                    f"installed (pip install {BNB_REQUIREMENT})")
                if on_cuda:
                    self.enforce_eager = True  # no CUDA graphs over bitsandbytes layers (class docstring)

    def _resolve_kv_and_backend(self, on_cuda: bool) -> None:
        """Validate --kv-cache-dtype / --kv-scales / --attention-backend (issue 4)."""
        import os

        from llmd.quant.kv import KV_CACHE_FORMATS
        from llmd.quant.kv_format import CPU_ONLY_FORMATS

        fp16_kv = os.environ.get("LLMD_FP16_KV") != "0"
        if self.kv_cache_dtype == "auto" and self._gguf_float32_by_auto(on_cuda) and fp16_kv:
            # --dtype auto chose float32 (no native bf16): K/V in float16, as llama.cpp's default f16 cache
            self.kv_cache_dtype = "float16"  # half the bytes per decode; an explicit --dtype float32 keeps float32
        if self.kv_cache_dtype not in KV_CACHE_FORMATS:
            raise LlmdError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_FORMATS)}, "
                            f"got {self.kv_cache_dtype!r}")
        if self.kv_scales is not None:
            if not KV_CACHE_FORMATS[self.kv_cache_dtype].quantized:
                raise LlmdError("--kv-scales needs an 8-bit --kv-cache-dtype (int8, fp8_e4m3, fp8_e5m2)")
            if len(self.kv_scales) != 2 or not all(s > 0 and s != float("inf") for s in self.kv_scales):
                raise LlmdError(f"--kv-scales must be two positive finite numbers k,v; got {self.kv_scales}")
            self.kv_scales = (float(self.kv_scales[0]), float(self.kv_scales[1]))
        if self.kv_scales is not None and KV_CACHE_FORMATS[self.kv_cache_dtype].packed:
            raise LlmdError(f"--kv-scales needs an 8-bit --kv-cache-dtype; {self.kv_cache_dtype} has dynamic "
                            "per-group scales only")
        if self.kv_rotation is None:
            self.kv_rotation = DEFAULT_KV_ROTATION.get(self.kv_cache_dtype, "none")
        if self.kv_rotation not in ("none", "hadamard"):
            raise LlmdError(f"--kv-rotation must be none or hadamard, got {self.kv_rotation!r}")
        if self.kv_rotation != "none" and not KV_CACHE_FORMATS[self.kv_cache_dtype].quantized:
            raise LlmdError("--kv-rotation hadamard needs a quantized --kv-cache-dtype (int8, int4, fp8_e4m3, "
                            f"fp8_e5m2); {self.kv_cache_dtype} stores K/V unquantized")
        if self.attention_backend is None:  # float64 runs are reference runs: the oracle
            self.attention_backend = "triton" if on_cuda else ("torch" if self.dtype == "float64" else "cpu")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise LlmdError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                            f"got {self.attention_backend!r}")
        if self.kv_cache_dtype in CPU_ONLY_FORMATS and self.attention_backend == "triton":
            raise LlmdError(f"--kv-cache-dtype {self.kv_cache_dtype} needs --attention-backend cpu or torch "
                            "(the Triton kernels read auto, int8, fp8 and int4 caches)")
        if self.attention_backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise LlmdError("--attention-backend triton on CPU needs TRITON_INTERPRET=1 (the Triton interpreter, slow)")
        self.kv_scale_group_size = int(self.kv_scale_group_size or 0)
        if self.kv_scale_group_size:
            try:
                get_format(self.kv_cache_dtype, self.kv_scale_group_size)
            except ValueError as e:
                raise LlmdError(str(e)) from None
            if self.kv_scales is not None:
                raise LlmdError("--kv-scale-group-size needs dynamic scales: --kv-scales sets one per-tensor scale")
            if self.attention_backend == "triton":
                raise LlmdError("--kv-scale-group-size needs --attention-backend cpu or torch: the Triton kernels read "
                                "one scale per (token, KV head)")

    @property
    def kv_format(self) -> "KVCacheFormat":
        """The resolved ``--kv-cache-dtype`` with ``--kv-scale-group-size`` (:mod:`llmd.quant.kv_format`)."""
        return get_format(self.kv_cache_dtype, self.kv_scale_group_size)

    def wants_fused_decode(self, cfg) -> bool:
        """Whether to pack the weights for the fused single-stream decode kernel too
        (:mod:`llmd.kernels.cpu_fused`): CPU, the cpu backend with its native kernels, ``gguf``
        weights (``--weight-quant auto`` on a bfloat16 CPU, or ``gguf``), an unquantized cache
        (auto, float16, bfloat16) without rotation, blocks the C kernels take (``--block-size`` <=
        ``cpu_native.MAX_BLOCK``), a Llama-architecture file (``cfg``: its
        :class:`~llmd.models.config.ModelConfig`), and the kernel builds for its shape here (~3 s
        the first time on a machine)."""
        from llmd.kernels import cpu_fused, cpu_native

        if (self.device != "cpu" or self.attention_backend != "cpu" or self.disable_native_kernels
                or self.weight_quant != "gguf" or self.kv_format.quantized or self.kv_rotation != "none"
                or self.block_size > cpu_native.MAX_BLOCK or cfg.architecture not in ("llama",)):
            return False

        group = cfg.num_heads // max(1, cfg.num_kv_heads)
        return cfg.head_dim % 16 == 0 and group <= 16 and cpu_fused.available(cfg.head_dim, group)

    def settle_weight_quant(self, cfg) -> bool:
        """:meth:`wants_fused_decode` for the model ``cfg``, and a float32 ``--weight-quant auto``
        (whose packs only serve the fused kernel) set to "none" when that kernel will not run."""
        fused = self.wants_fused_decode(cfg)
        if getattr(self, "packs_for_fused_only", False) and not fused:
            self.weight_quant, self.packs_for_fused_only = "none", False
        return fused

    @property
    def keep_dense(self) -> bool:
        """Whether packed layers keep their dense weights (``weight_quant`` was "auto")."""
        return getattr(self, "keep_dense_weights", False)
