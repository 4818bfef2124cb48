"""How llmd's C kernels are compiled; :mod:`llmd.kernels.native.build` loads them, types their
functions and re-exports every name here.

* :data:`SOURCES`: the library name -> its ``.c`` file (beside this module); :data:`HEADERS`: every
  ``*.h`` beside them, which the sources include; :data:`FLAGS`: the compiler switches of every build.
* :func:`_compiler`: ``$CC``, else ``cc`` or ``gcc`` on PATH, or None.
* :func:`_build`: one library compiled into :func:`cache_dir` as ``{name}-{digest}.so``, the digest
  a hash of every source and header, the flags and the compiler's version, so an edit, another CPU
  (``-march=native``) or another compiler rebuilds and a second process reuses it; written to a
  temporary name, then renamed (concurrent builders do not collide). Raises RuntimeError with the
  compiler's last line when it fails.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("paged_decode.c")
# fused_decode.c includes paged_decode.c (its attention)
SOURCES = {"paged_decode": SOURCE, "fused_decode": Path(__file__).with_name("fused_decode.c"),
           "layer_glue": Path(__file__).with_name("layer_glue.c"),  # layer_glue.c includes paged_decode.c too
           "bf16_scores": Path(__file__).with_name("bf16_scores.c"),
           "kv_read": Path(__file__).with_name("kv_read.c"),
           "amx_linear": Path(__file__).with_name("amx_linear.c"),
           "dp_linear": Path(__file__).with_name("dp_linear.c")}
# headers the sources include (every *.h beside them, so a new one cannot be left out): part of every build's hash
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# no -ffast-math: with GCC < 13 linking a shared object with it adds crtfastmath.o, whose constructor
# sets the FTZ/DAZ bits of the loading thread's MXCSR: every later float op of the process would flush
# subnormals (hypothesis refuses to run then). The kernel's vector code is explicit, so it needs none of it.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


def cache_dir() -> Path:
    """Where built kernels live: ``$XDG_CACHE_HOME/llmd/native`` (default ``~/.cache/llmd/native``),
    beside the rest of llmd's cache (:mod:`llmd.models.paths`, a layer above this one)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "llmd" / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or (shutil.which("gcc") if not os.environ.get("CC") else None)


def _build(cc: str, flags: list[str], name: str = "paged_decode") -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    sources = b"".join(p.read_bytes() for p in [*SOURCES.values(), *HEADERS])  # fused_decode.c includes the rest
    digest = hashlib.sha256(sources + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{digest}.so"
    source = SOURCES[name]
    if out.exists():
        return out
    os.makedirs(out.parent.parent, mode=0o700, exist_ok=True)  # llmd's cache directory is private (models/paths.py)
    out.parent.mkdir(mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"
            raise RuntimeError(f"{cc} failed: {last}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
