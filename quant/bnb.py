"""bitsandbytes, imported only when a ``--weight-quant`` format needs it (``nf4``, ``fp4``, CUDA ``int8``).

``import bitsandbytes`` (0.50.2, torch 2.13 CPU) takes ~2 s (its default backend imports
``torch._dynamo`` for a ``torch.compile`` wrapper) and, on a CPU with AVX512-BF16, its CPU backend
(``bitsandbytes/backends/cpu/ops.py``, at import time) runs ``from kernels import get_kernel`` to
fetch ``kernels-community/quantization-bitsandbytes`` from the Hugging Face hub; there is no
environment variable to turn that off. Offline it fails with a logged warning, and in a process
started from llmd's repository root the name ``kernels`` is llmd's own ``kernels/`` folder.
:func:`import_bitsandbytes` therefore imports it with ``sys.modules["kernels"] = None`` (the
lookup raises ImportError at once, nothing is fetched) and that module's logger silenced, then
restores both (torch's DeprecationWarnings raised during the import are dropped too).
bitsandbytes then uses its bundled ``libbitsandbytes_cpu`` kernels
(``gemv_4bit_inference_cpu_nf4_bf16``), which are the ones measured in the README.

:func:`bitsandbytes_available` answers without importing it (``importlib.util.find_spec``), so the
engine's configuration can refuse a format before any weights load, and ``llmd kv-size`` / a
default ``llmd serve`` never import it.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings

BNB_REQUIREMENT = "bitsandbytes==0.50.2"  # pyproject's pin: the version whose CPU kernels were measured
_NOISY_LOGGER = "bitsandbytes.backends.cpu.ops"


def bitsandbytes_available() -> bool:
    """Whether ``import bitsandbytes`` can find the package (not imported here; a name set to
    None in ``sys.modules``, as tests do to simulate its absence, counts as missing)."""
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"] is not None
    try:
        return importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):
        return False


def import_bitsandbytes():
    """The ``bitsandbytes`` module, imported without its hub lookup (see the module docstring).

    Raises:
        ImportError: bitsandbytes is not installed or fails to import (message names the pin).
    """
    if sys.modules.get("bitsandbytes") is not None:
        return sys.modules["bitsandbytes"]
    had_kernels, saved = "kernels" in sys.modules, sys.modules.get("kernels")
    log = logging.getLogger(_NOISY_LOGGER)
    level = log.level
    sys.modules["kernels"] = None  # ``from kernels import get_kernel`` raises ImportError, fetches nothing
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():  # torch's own DeprecationWarnings from the import (torch.jit.script_method)
            warnings.simplefilter("ignore", DeprecationWarning)
            import bitsandbytes
    except Exception as e:  # ImportError, or a broken native library
        raise ImportError(f"bitsandbytes failed to import ({type(e).__name__}: {e}); "
                          f"pip install {BNB_REQUIREMENT}") from e
    finally:
        log.setLevel(level)
        if had_kernels:
            sys.modules["kernels"] = saved
        else:
            sys.modules.pop("kernels", None)
    return bitsandbytes
