"""The C kernels compile for the x86 targets llmd users run, not only for this machine's
``-march=native``: every source build.py builds, with its flags, for a baseline x86-64, AVX2
(x86-64-v3: Zen 1-3, Haswell+), AVX-512 without VNNI or BF16 (x86-64-v4: Skylake-SP), and
AVX-512 with BF16 and AMX (Sapphire Rapids). A branch that only one vector width reaches (as
fused_decode.c's AVX2 code did on Skylake-SP: 8-lane intrinsics on 16-lane vectors) fails here
on any machine with the compiler. At -O0 (~9 s for all four): the front end's type checks and
the intrinsics' target checks run at any level."""

from __future__ import annotations

import platform
import subprocess

import pytest

from llmd.kernels.native import build

CC = build._compiler()
pytestmark = pytest.mark.skipif(CC is None or platform.machine() not in ("x86_64", "AMD64"),
                                reason="needs a C compiler targeting x86-64")
TARGETS = ("x86-64", "x86-64-v3", "x86-64-v4", "sapphirerapids")


@pytest.mark.parametrize("target", TARGETS)
def test_every_source_compiles_for(target, tmp_path):
    flags = [f for f in build.FLAGS if f not in ("-march=native", "-O3", "-shared")]
    for name, source in build.SOURCES.items():
        cmd = [CC, *flags, "-O0", f"-march={target}", "-DSPEC_NV=4", "-DSPEC_G=3", "-c", str(source),
               "-o", str(tmp_path / f"{name}.o")]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{name}.c for -march={target}:\n{r.stderr[-3000:]}"
