"""tests/kernels: the cubin compiles of ``test_kernel_compile.py`` run beside the single-threaded
Triton-interpreter tests (tests/fixtures/background_compiles.py), and after them."""

from __future__ import annotations

from pathlib import Path

import pytest
from background_compiles import BackgroundCompiles

HERE = Path(__file__).parent
COMPILE_MODULE = "test_kernel_compile.py"
#: modules whose tests run the Triton interpreter (one core busy): the compiles start with the first
INTERPRETER_MODULES = {"test_kernels.py", "test_kivi_triton.py", "test_rotation_triton.py"}


def pytest_collection_modifyitems(config, items):
    """The compile tests move to the end of this directory's tests, after the interpreter tests
    they overlap with (their order among themselves, and every other test's, is kept)."""
    compile_items = [it for it in items if it.path.parent == HERE and it.path.name == COMPILE_MODULE]
    if not compile_items:
        return
    moved = set(map(id, compile_items))
    rest = [it for it in items if id(it) not in moved]
    ours = [i for i, it in enumerate(rest) if it.path.parent == HERE]
    at = ours[-1] + 1 if ours else len(rest)
    items[:] = rest[:at] + compile_items + rest[at:]


@pytest.fixture(scope="session")
def background_compiles(request, tmp_path_factory):
    """The :class:`BackgroundCompiles` of the selected compile cases (``-k`` applies), started on
    first use; None when no compile test is selected."""
    items = [it for it in request.session.items if it.path.parent == HERE and it.path.name == COMPILE_MODULE]
    cases = [it.callspec.params["kernel_case"] for it in items
             if "kernel_case" in getattr(getattr(it, "callspec", None), "params", {})]
    if not cases:
        yield None
        return
    module = items[0].module
    cache_dir = str(tmp_path_factory.mktemp("triton-cache"))
    compiles = BackgroundCompiles(module.compile_case, [(module._case_id(kc), kc) for kc in cases],
                                  module._init_worker, (cache_dir,))
    yield compiles
    compiles.close()


@pytest.fixture(autouse=True)
def _compile_beside_the_interpreter(request):
    if request.node.path.name in INTERPRETER_MODULES:
        request.getfixturevalue("background_compiles")
