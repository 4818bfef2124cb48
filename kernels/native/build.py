"""Compile and load llmd's C kernels for CPUs with the system C compiler: ``paged_decode.c`` (the
cpu backend's decode attention, :func:`load`), ``fused_decode.c`` (a whole batch-1 decode step,
which includes the former for its attention; :func:`load_fused`), ``layer_glue.c`` (a bfloat16
or float32 layer's RMSNorm / RoPE / SwiGLU passes, :func:`load_glue`; one build for every shape) and
``bf16_scores.c`` (float32 attention scores of bfloat16 queries and keys, :func:`load_scores`) and
``kv_read.c`` (the KV-gather read ``llmd bench step`` times as a floor, :func:`load_kv_read`) and
``amx_linear.c`` (bfloat16 linears on AMX tiles, :func:`load_amx_linear`), ``dp_linear.c`` (the same
linears by VDPBF16PS where AMX is not granted, :func:`load_dp_linear`).

The source ships in the package; the shared object is built on first use on the machine that
runs it (``-march=native``: the kernel uses whatever vector units this CPU has), once per model
shape (``-DSPEC_NV=head_dim/16 -DSPEC_G=query heads per KV head``: that shape's loops unrolled),
into ``$XDG_CACHE_HOME/llmd/native`` (default ``~/.cache/llmd/native``), named by a hash of the
source, the flags and the compiler's version, so an edit or another CPU rebuilds and a second
process reuses it (written to a temporary name, then renamed: concurrent builders do not
collide). A build takes ~3 s on the 2-core machine (plain C, no torch headers). The compile itself
(sources, switches, compiler, cache key) is :mod:`llmd.kernels.native.compiler` (re-exported here).

OpenMP: ``-fopenmp`` links ``libgomp.so.1``; torch's wheel loads its own copy under that soname
first (``import torch`` happens before this module loads the kernel), so the dynamic loader binds
the kernel to the same runtime and both use one thread team instead of two competing for the cores.

Nothing here raises: :func:`load` returns None when there is no compiler, the build fails or
``LLMD_NATIVE_KERNELS=0`` is set, and says why once (logger ``llmd.kernels``); the callers then
take the pure-torch path, which computes the same attention.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess

import torch  # noqa: F401  (loads torch's libgomp before the kernel's NEEDED entry is resolved)

from llmd.kernels.native.compiler import (  # noqa: F401 (re-exported: the sources, the switches, the compile)
    FLAGS,
    HEADERS,
    SOURCE,
    SOURCES,
    _build,
    _compiler,
    cache_dir,
)

log = logging.getLogger("llmd.kernels")
_cache: dict[tuple[int, int] | None, ctypes.CDLL | None] = {}  # paged_decode builds per shape
_fused: dict[tuple[int, int] | None, ctypes.CDLL | None] = {}  # fused_decode builds per shape
why_not: str | None = None  # why the kernel is unavailable, once load() has been called


def loaded(shape: tuple[int, int] | None) -> ctypes.CDLL | None:
    """The library :func:`load` already loaded for ``shape``, else None (never builds)."""
    return _cache.get(shape)


def load(shape: tuple[int, int] | None = None) -> ctypes.CDLL | None:
    """The kernel library for ``shape = (head_dim // 16, query heads per KV head)`` (specialized
    for it; None: the runtime-shape build), its ``llmd_paged_decode`` typed, or None when it is
    unavailable (see the module docstring; the reason is in :data:`why_not`)."""
    global why_not
    if shape in _cache:
        return _cache[shape]
    lib = None
    if os.environ.get("LLMD_NATIVE_KERNELS", "1") == "0":
        why_not = "LLMD_NATIVE_KERNELS=0"
    elif (cc := _compiler()) is None:
        why_not = "no C compiler (cc/gcc, or $CC) on PATH"
    elif why_not is not None and why_not.startswith("build failed"):
        pass  # a failed build is not retried per shape
    else:
        spec = [f"-DSPEC_NV={shape[0]}", f"-DSPEC_G={shape[1]}"] if shape else []
        try:
            lib = ctypes.CDLL(str(_build(cc, FLAGS + spec)))
            fn = lib.llmd_paged_decode
            c = ctypes
            fn.argtypes = [c.c_void_p, c.c_int, c.c_int64, c.c_void_p, c.c_int, c.c_void_p, c.c_void_p,
                           c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_int, c.c_int, c.c_void_p, c.c_int64, c.c_void_p,
                           c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_float, c.c_void_p, c.c_int,
                           c.c_void_p, c.c_int]
            fn.restype = c.c_int
            lib.llmd_paged_decode_amx.argtypes, lib.llmd_paged_decode_amx.restype = [], c.c_int
            lib.llmd_paged_decode_set_amx.argtypes, lib.llmd_paged_decode_set_amx.restype = [c.c_int], c.c_int
            lib.llmd_paged_decode_dot.argtypes, lib.llmd_paged_decode_dot.restype = [], c.c_int
            lib.llmd_paged_decode_set_dot.argtypes, lib.llmd_paged_decode_set_dot.restype = [c.c_int], c.c_int
            lib.llmd_paged_decode_set_avx2.argtypes, lib.llmd_paged_decode_set_avx2.restype = [c.c_int], c.c_int
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            why_not, lib = f"build failed: {e}", None
    if lib is None and not _cache:
        log.warning("llmd: native CPU decode kernel unavailable (%s); using the torch path", why_not)
    _cache[shape] = lib
    return lib


def load_fused(shape: tuple[int, int] | None) -> ctypes.CDLL | None:
    """The fused single-stream decode library (``fused_decode.c``) for ``shape`` (as :func:`load`;
    None: the runtime-shape build, whose attention takes any shape, ~10 % slower at SmolLM2's),
    its ``llmd_fused_decode`` typed, or None when it is unavailable: as :func:`load`, or the CPU
    has neither AVX512-VNNI/BW/VL nor AVX2/FMA/F16C (the library then reports ``llmd_fused_supported() == 0``). Says why
    once (``fused_why_not``)."""
    global fused_why_not
    if shape in _fused:
        return _fused[shape]
    lib = None
    if load(shape) is None:  # the same compiler, switches and build; a failure there is reported there
        fused_why_not = why_not
    else:
        try:
            spec = [f"-DSPEC_NV={shape[0]}", f"-DSPEC_G={shape[1]}"] if shape else []
            lib = ctypes.CDLL(str(_build(_compiler(), FLAGS + spec, "fused_decode")))
            if lib.llmd_fused_supported() != 1:
                fused_why_not, lib = "this CPU has neither AVX512-VNNI/BW/VL nor AVX2/FMA/F16C", None
            else:
                c = ctypes
                fn = lib.llmd_fused_decode
                fn.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_int64, c.c_int64, c.c_void_p,
                               c.c_int64, c.c_void_p, c.c_void_p, c.c_int]
                fn.restype = c.c_int
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            fused_why_not, lib = f"build failed: {e}", None
    if lib is None:
        log.warning("llmd: fused single-stream decode kernel unavailable (%s); using the torch path", fused_why_not)
    _fused[shape] = lib
    return lib


fused_why_not: str | None = None  # why load_fused() found no library


def load_glue() -> ctypes.CDLL | None:
    """The layer-glue library (``layer_glue.c`` with ``layer_glue_f32.h``; no shape specialization), its ten functions
    typed, or None when unavailable (as :func:`load`: no compiler, a failed build,
    ``LLMD_NATIVE_KERNELS=0``; or ``LLMD_LAYER_GLUE=0``); says why once (``glue_why_not``)."""
    global glue_why_not
    if "glue" in _glue:
        return _glue["glue"]
    lib = None
    if os.environ.get("LLMD_LAYER_GLUE", "1") == "0":  # the A/B switch of this kernel alone
        glue_why_not = "LLMD_LAYER_GLUE=0"
    elif load() is None:  # the same compiler and switches; a failure there is reported there
        glue_why_not = why_not
    else:
        try:
            lib = ctypes.CDLL(str(_build(_compiler(), FLAGS, "layer_glue")))
            c = ctypes
            lib.llmd_rms_norm_bf16.argtypes = [c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_int, c.c_float,
                                               c.c_void_p, c.c_int]
            lib.llmd_rope_bf16.argtypes = [c.c_void_p, c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_void_p,
                                           c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_int]
            lib.llmd_silu_mul_bf16.argtypes = [c.c_void_p, c.c_int64, c.c_int64, c.c_int, c.c_void_p, c.c_int]
            lib.llmd_add_rms_norm_bf16.argtypes = [c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_int64, c.c_int,
                                                   c.c_float, c.c_void_p, c.c_int]
            lib.llmd_rope_store_bf16.argtypes = [c.c_void_p, c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_int,
                                                 c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p,
                                                 c.c_int64, c.c_void_p, c.c_int]
            lib.llmd_store_int8.argtypes = [c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_int64, c.c_int,
                                            c.c_int, c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_void_p,
                                            c.c_float, c.c_int]
            lib.llmd_rms_norm_f32.argtypes = lib.llmd_rms_norm_bf16.argtypes  # layer_glue_f32.h: float32 twins
            lib.llmd_add_rms_norm_f32.argtypes = lib.llmd_add_rms_norm_bf16.argtypes
            lib.llmd_silu_mul_f32.argtypes = lib.llmd_silu_mul_bf16.argtypes
            lib.llmd_rope_store_f32.argtypes = lib.llmd_rope_store_bf16.argtypes[:-1] + [c.c_int, c.c_int]
            for fn in (lib.llmd_rms_norm_bf16, lib.llmd_rope_bf16, lib.llmd_silu_mul_bf16, lib.llmd_add_rms_norm_bf16,
                       lib.llmd_rope_store_bf16, lib.llmd_store_int8, lib.llmd_rms_norm_f32, lib.llmd_add_rms_norm_f32,
                       lib.llmd_silu_mul_f32, lib.llmd_rope_store_f32):
                fn.restype = None
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            glue_why_not, lib = f"build failed: {e}", None
    if lib is None:
        log.warning("llmd: native layer glue unavailable (%s); using the torch ops", glue_why_not)
    _glue["glue"] = lib
    return lib


_glue: dict[str, ctypes.CDLL | None] = {}
glue_why_not: str | None = None  # why load_glue() found no library


def load_scores() -> ctypes.CDLL | None:
    """The bfloat16-scores library (``bf16_scores.c``), ``llmd_bf16_scores`` typed, or None when
    unavailable: as :func:`load`, or this CPU has no AVX512-BF16 (the build then reports
    ``llmd_bf16_scores_supported() == 0``); says why once (``scores_why_not``)."""
    global scores_why_not
    if "scores" in _scores:
        return _scores["scores"]
    lib = None
    if load() is None:  # the same compiler and switches; a failure there is reported there
        scores_why_not = why_not
    else:
        try:
            lib = ctypes.CDLL(str(_build(_compiler(), FLAGS, "bf16_scores")))
            if lib.llmd_bf16_scores_supported() != 1:
                scores_why_not, lib = "this CPU has no AVX512-BF16", None
            else:
                c = ctypes
                lib.llmd_bf16_scores.argtypes = [c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_int64,
                                                 c.c_void_p, c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_void_p,
                                                 c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_int, c.c_int, c.c_float,
                                                 c.c_int]
                lib.llmd_bf16_scores.restype = c.c_int
                lib.llmd_bf16_attn_probs.argtypes = [c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64,
                                                     c.c_int64, c.c_void_p, c.c_int64, c.c_int64, c.c_int, c.c_int,
                                                     c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_int,
                                                     c.c_int, c.c_int, c.c_int, c.c_float, c.c_int]
                lib.llmd_bf16_attn_probs.restype = c.c_int
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            scores_why_not, lib = f"build failed: {e}", None
    _scores["scores"] = lib
    return lib


_scores: dict[str, ctypes.CDLL | None] = {}
scores_why_not: str | None = None  # why load_scores() found no library



_kv_read: dict[str, ctypes.CDLL | None] = {}


def load_kv_read() -> ctypes.CDLL | None:
    """The KV-gather read (``kv_read.c``), ``llmd_kv_gather_read`` typed, or None when the C
    kernels are unavailable (as :func:`load`) or its build failed."""
    if "lib" not in _kv_read:
        lib = None
        if load() is not None:
            try:
                lib = ctypes.CDLL(str(_build(_compiler(), FLAGS, "kv_read")))
                c = ctypes
                lib.llmd_kv_gather_read.argtypes = [c.c_void_p, c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_int64,
                                                    c.c_int, c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p,
                                                    c.c_int, c.c_int]
                lib.llmd_kv_gather_read.restype = c.c_uint64
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                log.warning("llmd: the KV-gather read did not build (%s)", e)
        _kv_read["lib"] = lib
    return _kv_read["lib"]


_linears: dict[str, ctypes.CDLL | None] = {}


def load_amx_linear() -> ctypes.CDLL | None:
    """The AMX linear library (``amx_linear.c``), ``llmd_amx_linear`` and ``llmd_amx_linear_ready``
    typed, or None when unavailable (as :func:`load`: no compiler, a failed build,
    ``LLMD_NATIVE_KERNELS=0``). On a CPU without AMX it loads, and ``llmd_amx_linear_ready()`` is 0."""
    return _load_linear("amx_linear", "AMX")


def load_dp_linear() -> ctypes.CDLL | None:
    """The VDPBF16PS linear library (``dp_linear.c``), ``llmd_dp_linear`` and ``llmd_dp_linear_ready``
    typed (the signature of :func:`load_amx_linear`'s), or None when unavailable (as :func:`load`).
    On a CPU without AVX512-BF16 it loads, and ``llmd_dp_linear_ready()`` is 0."""
    return _load_linear("dp_linear", "VDPBF16PS")


def _load_linear(name: str, label: str) -> ctypes.CDLL | None:
    """Build and type ``{name}.c``'s ``llmd_{name}(x, ldx, w, y, M, K, N, threads) -> int`` and
    ``llmd_{name}_ready() -> int`` once per process; None (one warning) when the build fails."""
    if name in _linears:
        return _linears[name]
    lib = None
    if load() is not None:  # the same compiler and switches; a failure there is reported there
        try:
            lib = ctypes.CDLL(str(_build(_compiler(), FLAGS, name)))
            c = ctypes
            product, ready = getattr(lib, f"llmd_{name}"), getattr(lib, f"llmd_{name}_ready")
            product.argtypes = [c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int]
            product.restype = c.c_int
            ready.argtypes, ready.restype = [], c.c_int
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            log.warning("llmd: %s linear kernel unavailable (build failed: %s); oneDNN runs the linears", label, e)
            lib = None
    _linears[name] = lib
    return lib
