"""The engine is built on the engine loop's own thread when given a factory (why: the
``engine_loop`` module docstring; one OpenMP team per process), and a factory's failure
reaches whoever waits for the loop, once, without a hung thread."""

import asyncio
import threading

import pytest
from tiny_engine import tiny_engine

from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.request import SamplingParams
from llmd.daemon.serving.engine_loop import EngineLoop
from llmd.daemon.serving.lifecycle import run_server


def test_factory_runs_on_the_engine_thread_and_serves(tmp_path):
    seen = {}

    def factory():
        seen["thread"] = threading.current_thread().name
        return tiny_engine(tmp_path / "tiny.gguf")

    loop = EngineLoop(factory, "tiny").start()
    try:
        engine = loop.ready.result(timeout=60)
        assert seen["thread"] == "llmd-engine" != threading.current_thread().name
        assert loop.engine is engine and loop.snapshot()["model"] == "tiny"
        done = threading.Event()
        outs = []

        def sink(out):
            outs.append(out)
            if out.finished:
                done.set()

        loop.submit("r1", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), 1, sink)
        assert done.wait(60)
        assert sum(len(o.new_token_ids) for o in outs) == 3 and [o.finished for o in outs].count(True) == 1
    finally:
        loop.stop()


def test_factory_failure_resolves_ready_and_ends_the_thread():
    def factory():
        raise LlmdError("no such model: nope")

    loop = EngineLoop(factory, "x").start()
    with pytest.raises(LlmdError, match="nope"):
        loop.ready.result(timeout=10)
    loop._thread.join(5)
    assert not loop._thread.is_alive()


def test_run_server_propagates_the_factory_error_and_removes_the_socket(tmp_path):
    sock = tmp_path / "s.sock"

    def factory():
        raise LlmdError("model file unreadable")

    with pytest.raises(LlmdError, match="unreadable"):
        asyncio.run(run_server(factory, str(sock), "x", ("x",), echo=lambda m: None))
    assert not sock.exists()


def test_freeze_gc_freezes_the_startup_heap_once_the_engine_is_built(tmp_path):
    """``llmd serve``'s loop (``freeze_gc=True``) moves everything alive after the engine is built
    into the permanent generation, so a full collection skips it; the default leaves the heap
    alone. (The frozen objects are thawed afterwards: this is the test runner's process.)"""
    import gc

    gc.unfreeze()
    plain = EngineLoop(lambda: tiny_engine(tmp_path / "a.gguf"), "tiny").start()
    try:
        plain.ready.result(timeout=60)
        assert gc.get_freeze_count() == 0
    finally:
        plain.stop()
    loop = EngineLoop(lambda: tiny_engine(tmp_path / "b.gguf"), "tiny", freeze_gc=True).start()
    try:
        engine = loop.ready.result(timeout=60)
        assert gc.get_freeze_count() > 1000 and loop.engine is engine
    finally:
        loop.stop()
        gc.unfreeze()
