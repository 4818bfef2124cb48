"""tests/serving: the module-scoped engine loop its in-process app tests share (a module that
needs other limits, metrics or a real model defines its own ``engine_loop``, which wins)."""

from __future__ import annotations

import pytest
from app_harness import start_loop


@pytest.fixture(scope="module")
def engine_loop(tmp_path_factory):
    """A started loop over a fresh tiny engine (at most 4 sequences running), one per test
    module; stopped after the module, which must have left no request live and no block held."""
    loop = start_loop(tmp_path_factory, max_num_seqs=4)
    yield loop
    loop.stop()
    assert loop.engine.kv_manager.num_used_blocks == 0 and not loop.engine.requests
