"""Ctrl-C in the first ~60 ms of ``llmd serve`` ends as one a moment later does (``llmd:
interrupted``, exit 130, no traceback, nothing left on the socket's path): while the script
imported click it was a ``KeyboardInterrupt`` traceback and a death by SIGINT (exit -2); while
click parsed the arguments and imported the command's module, click's ``Abort`` (``llmd:
aborted``, exit 1). From its checks on, a Ctrl-C drains instead (exit 0, ``llmd: stopped``:
tests/cli/test_serve_starting.py), also while the model loads, where it (and SIGTERM, ``llmd
stop``) used to abort the process (``terminate called without an active exception``, exit -6).

The SIGINT is real (``os.kill``) but sent from a meta-path finder the moment a given module is
first imported, so each window is hit every time instead of by racing a timer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: runs ``llmd serve ...`` (argv after ``-c``), sending itself SIGINT when ``argv``'s module first imports
RUN = """import os, signal, sys
NAME = os.environ["INTERRUPT_AT"]
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == NAME:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
from llmd.daemon.cli.main import main
main()
"""


@pytest.mark.parametrize("module", [
    "click.types",  # the script imports click (llmd.daemon.cli.main)
    "llmd.daemon.cli.daemon",  # click has parsed `serve` and imports its module
    "llmd.daemon.core.config",  # later: serve has claimed its socket and checks its options
])
def test_an_early_ctrl_c_is_one_line_and_exit_130(tmp_path, module):
    args = ["serve", "--socket", str(tmp_path / "d.sock"), "--model", "random:qwen3-0.6b:layers=1"]
    res = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, INTERRUPT_AT=module))
    assert res.returncode == 130, (res.returncode, res.stderr)
    # one line; in click's own window (parsing, loading the command) after the newline click writes on a
    # Ctrl-C (on a terminal it ends the line the ^C was echoed on)
    expected = "\nllmd: interrupted\n" if module == "llmd.daemon.cli.daemon" else "llmd: interrupted\n"
    assert res.stderr == expected, res.stderr
    assert os.listdir(tmp_path) == []  # no socket, no <socket>.lock


#: ``llmd serve ...`` whose engine "loads" forever in torch calls that release the GIL, the
#: signal ``SIGNAL`` sent to itself as the load starts
LOADING = """import os, signal, time
import llmd.daemon.cli.daemon as d
def build(**kw):
    import torch
    os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))
    a, deadline = torch.ones(256, 256), time.monotonic() + 30
    while time.monotonic() < deadline:
        a @ a
    raise RuntimeError("the load was never left behind")
d.build_engine = build
from llmd.daemon.cli.main import main
main()
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_the_model_loads_stops_with_exit_0(tmp_path, sig):
    """The load cannot be interrupted and is not waited for: ``serve`` exits at once past the
    engine thread (``daemon._exit_past_the_engine_thread``), where Python's exit finalized the
    interpreter under it and the thread's next GIL take from inside torch aborted the process."""
    args = ["serve", "--socket", str(tmp_path / "d.sock"), "--model", "random:qwen3-0.6b:layers=1"]
    res = subprocess.run([sys.executable, "-c", LOADING, *args], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, SIGNAL=sig, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, (res.returncode, res.stderr)
    assert res.stderr.strip().splitlines()[-1] == "llmd: stopped" and "Traceback" not in res.stderr, res.stderr
    assert os.listdir(tmp_path) == []
