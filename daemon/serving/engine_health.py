"""The engine loop's health: step failures with their backoff, and what ``GET /health`` says.

The engine thread writes, any thread reads (plain attribute reads and writes; the GIL makes
each one atomic, and a reader only ever needs a recent value).

* A step that raises as a whole ends every live request (the engine loop does that) and
  counts here: :attr:`EngineHealth.engine_errors` (``llmd:engine_errors_total``) and the
  consecutive :attr:`EngineHealth.step_failures`, after which the next step waits
  :func:`step_backoff` seconds (50 ms, doubling, capped at 2 s): a fault that recurs every
  step cannot spin a core on tracebacks, and one that clears costs at most a short pause.
  Commands (aborts, submits) still run during the wait. A step that succeeds resets the run.
* ``/health`` answers 200 only when :meth:`EngineHealth.check` says ``"ok"``; otherwise 503
  with the state: ``"loading"`` (the engine is still being built on its thread),
  ``"dead"`` (the engine thread is not running: the build failed or the thread ended),
  ``"stalled"`` (no loop iteration has finished for longer than the stall limit). vLLM's API
  server answers 503 when its engine core is dead for the same reason (its zombie-engine
  reports: a process that accepts connections but never answers). An idle loop finishes an
  iteration at least every 0.5 s (its command-queue wait), so only a step or a command that
  runs longer than the limit trips it; the limit (``llmd serve --health-stall-timeout``,
  default 120 s) must stay well above the slowest legitimate step (a 512-token CPU prefill
  chunk of a 1B model takes seconds, not minutes).
"""

from __future__ import annotations

import concurrent.futures as cf
import time

#: seconds before the step after the first failure; doubles per consecutive failure, up to the cap
STEP_BACKOFF_S = 0.05
STEP_BACKOFF_CAP_S = 2.0
DEFAULT_STALL_TIMEOUT_S = 120.0


def step_backoff(failures: int) -> float:
    """Seconds to wait before the next step after ``failures`` consecutive failed steps
    (0 for none): ``min(STEP_BACKOFF_CAP_S, STEP_BACKOFF_S * 2 ** (failures - 1))``."""
    return 0.0 if failures <= 0 else min(STEP_BACKOFF_CAP_S, STEP_BACKOFF_S * 2 ** (failures - 1))


class EngineHealth:
    """Failure counts, backoff and progress of one engine loop (see the module docstring).

    Attributes:
        engine_errors: steps that failed as a whole since the loop started.
        step_failures: consecutive failed steps (0 after a good one).
        resume_at: ``time.monotonic()`` before which no step runs (the backoff).
        progress_at: ``time.monotonic()`` when the last loop iteration finished.
    """

    def __init__(self):
        self.engine_errors = 0
        self.step_failures = 0
        self.resume_at = 0.0
        self.progress_at = time.monotonic()

    # ---- engine thread --------------------------------------------------------------
    def step_failed(self) -> float:
        """Count a failed step; returns the backoff (seconds) before the next one."""
        self.engine_errors += 1
        self.step_failures += 1
        wait = step_backoff(self.step_failures)
        self.resume_at = time.monotonic() + wait
        return wait

    def step_succeeded(self) -> None:
        self.step_failures = 0

    def backoff_left(self) -> float:
        """Seconds until a step may run again (0 when none is pending)."""
        return max(0.0, self.resume_at - time.monotonic())

    def progressed(self) -> None:
        """A loop iteration finished (or the engine became ready)."""
        self.progress_at = time.monotonic()

    # ---- any thread -----------------------------------------------------------------
    def check(self, ready: cf.Future, thread_alive: bool, stall_timeout: float) -> tuple[str, str | None]:
        """``("ok", None)`` or ``(state, reason)``: ``"loading"``, ``"dead"`` or ``"stalled"``.

        Args:
            ready: the loop's ready future (pending while the engine is built).
            thread_alive: whether the engine thread runs.
            stall_timeout: seconds without a finished iteration that mean "stalled".
        """
        if not ready.done():
            return "loading", "the model is loading"
        if ready.exception() is not None or not thread_alive:
            return "dead", "the engine thread is not running (see the daemon log)"
        quiet = time.monotonic() - self.progress_at
        if quiet > stall_timeout:
            return "stalled", (f"the engine has not finished a step for {quiet:.0f} s "
                               f"(stall limit {stall_timeout:g} s; see the daemon log)")
        return "ok", None
