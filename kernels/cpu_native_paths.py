"""Which vector path :mod:`llmd.kernels.cpu_native`'s decode kernel takes on this CPU, and the
switches that turn each off and back on (their C side: ``kernels/native/decode_switches.h``).

* :func:`amx_available` / :func:`set_amx`: scores on AMX tiles (``amx_decode.h``: bfloat16 queries
  over a bfloat16 cache; built with AMX, the tile state granted, ``LLMD_AMX_ATTENTION`` not 0);
  :func:`tile_scores`: whether a configuration (cache dtype, compute dtype, block size in tokens,
  head_dim) scores there.
* :func:`dot_available` / :func:`set_dot`: scores by VDPBF16PS (``bf16dp_decode.h``, AVX512-BF16;
  ``LLMD_BF16_DOT`` not 0); :func:`dot_scores`: whether a configuration scores there (the tile
  path, where it takes the configuration, goes first).
* :func:`set_avx2`: the 8-lane AVX2 loops (``decode_avx2.h``; builds without AVX-512).

The switches act on the runtime-shape build and, given ``head_dim`` and ``group``, on that shape's
build if :func:`llmd.kernels.cpu_native.prepare` loaded it; call them between steps, never during
one. Every name is re-exported by :mod:`llmd.kernels.cpu_native`.
"""

from __future__ import annotations

import torch

from llmd.kernels.native import build


def amx_available() -> bool:
    """The kernel was built with AMX on this CPU, the OS granted the tile state and
    ``LLMD_AMX_ATTENTION`` is not 0 (:func:`set_amx` may have turned it off since)."""
    lib = build.load()
    return lib is not None and lib.llmd_paged_decode_amx() == 1


def set_amx(on: bool, head_dim: int | None = None, group: int | None = None) -> bool:
    """Turn the tile-unit scores off or back on in the runtime-shape build and, with ``head_dim``
    and ``group``, that shape's build (side-by-side measurements and tests); returns whether they
    are on afterwards. Call between steps, never during one."""
    libs = [build.load(), build.loaded((head_dim // 16, group)) if head_dim and group else None]
    states = [lib.llmd_paged_decode_set_amx(int(on)) for lib in libs if lib is not None]
    return bool(states) and all(states)


def tile_scores(data_dtype: torch.dtype, cdt: torch.dtype, block_size: int, head_dim: int) -> bool:
    """:func:`decode` scores on the tile unit for this cache dtype, compute dtype, block size and
    head_dim: bfloat16 both, blocks a multiple of 16 slots, head_dim a multiple of 32, AMX on."""
    return (data_dtype == torch.bfloat16 and cdt == torch.bfloat16 and block_size % 16 == 0 and head_dim % 32 == 0
            and amx_available())


def dot_available() -> bool:
    """The kernel was built with AVX512-BF16 (bf16dp_decode.h) and ``LLMD_BF16_DOT`` is not 0
    (:func:`set_dot` may have turned it off since)."""
    lib = build.load()
    return lib is not None and lib.llmd_paged_decode_dot() == 1


def set_dot(on: bool, head_dim: int | None = None, group: int | None = None) -> bool:
    """Turn the AVX512-BF16 dot-product path off or back on, as :func:`set_amx`; returns whether
    it is on afterwards in the runtime-shape build and, with ``head_dim`` and ``group``, that
    shape's build. Call between steps, never during one."""
    libs = [build.load(), build.loaded((head_dim // 16, group)) if head_dim and group else None]
    states = [lib.llmd_paged_decode_set_dot(int(on)) for lib in libs if lib is not None]
    return bool(states) and all(states)


def set_avx2(on: bool, head_dim: int | None = None, group: int | None = None) -> bool:
    """Turn the 8-lane AVX2 loops (``kernels/native/decode_avx2.h``) off or back on, as
    :func:`set_amx`; returns whether they are on afterwards (False on builds without them: AVX-512
    or no AVX2). Call between steps, never during one."""
    libs = [build.load(), build.loaded((head_dim // 16, group)) if head_dim and group else None]
    states = [lib.llmd_paged_decode_set_avx2(int(on)) for lib in libs if lib is not None]
    return bool(states) and all(states)


def dot_scores(data_dtype: torch.dtype, cdt: torch.dtype, block_size: int, head_dim: int) -> bool:
    """:func:`decode` scores by VDPBF16PS (bf16dp_decode.h) for this configuration: bfloat16
    cache and compute, head_dim a multiple of 32, the path on, and the tile path not taking it."""
    return (data_dtype == torch.bfloat16 and cdt == torch.bfloat16 and head_dim % 32 == 0 and dot_available()
            and not tile_scores(data_dtype, cdt, block_size, head_dim))
