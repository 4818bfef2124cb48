"""Test-only fault injection: make one chosen request, or one whole engine step, fail on
purpose, so the failure paths are tested without hunting for a natural trigger.

Off unless enabled: :attr:`Engine.faults` is None by default, and each hook in the engine is
then one ``is None`` check. Tests enable it in-process (``FaultInjector.parse(spec).install(engine)``)
or, for a daemon subprocess, through the environment variable ``LLMD_FAULT_INJECT``, read
once when the engine is built (the daemon logs a warning then). Never set it in production.

The spec is comma-separated ``kind:seed[@n][=value]`` entries. A fault targets the requests
whose sampling ``seed`` is ``seed`` (the API's ``seed`` field, so a client picks the victim)
and fires once per request, at its ``n``-th output token (default 1):

* ``postprocess``: that request's postprocessing of its n-th token raises (where the
  detokenizer and the stop-string check run): that request alone must end with
  ``finish_reason="error"``, the others in the step go on;
* ``nan``: that request's logits row is NaN when its n-th token is sampled (a float16
  overflow's symptom): the sampler must fail that row alone;
* ``step``: the whole step raises once the scheduler has appended the step's tokens (so a
  request that finished in that very step has already left the scheduler): every live
  request must get a terminal output;
* ``hang``: the step sleeps ``value`` seconds (default 2) before returning, a stalled engine
  for the health check;
* ``kv_expire``, ``kv_pull_cut``, ``kv_pull_stall`` (prefill/decode disaggregation, the
  producer side, when a consumer pulls the pinned KV of a request with that seed): the pin is
  found expired; the pull's body is cut halfway (the producer dying mid-pull); the pull
  stalls ``value`` seconds before its body (a pull timeout).

Example: ``LLMD_FAULT_INJECT="postprocess:7001@2,step:7002@3,nan:7003"``.

Raises:
    ValueError (from :meth:`FaultInjector.parse`): a malformed spec, naming the entry.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ENV_VAR = "LLMD_FAULT_INJECT"
KINDS = ("postprocess", "nan", "step", "hang", "kv_expire", "kv_pull_cut", "kv_pull_stall")


class InjectedFault(RuntimeError):
    """The exception a ``postprocess`` or ``step`` fault raises."""


@dataclass(frozen=True)
class Fault:
    """One entry: ``kind`` fires for requests with sampling seed ``seed`` at output token
    ``at`` (1-based); ``value`` is the ``hang`` duration in seconds."""

    kind: str
    seed: int
    at: int = 1
    value: float = 2.0


class FaultInjector:
    """The faults of one engine (see the module docstring); call :meth:`install` to arm them.

    Attributes:
        faults: the parsed entries.
        fired: how many times each kind fired (tests read it).
    """

    def __init__(self, faults: list[Fault]):
        self.faults = faults
        self.fired = dict.fromkeys(KINDS, 0)
        self._done: set[tuple[str, str]] = set()  # (kind, request id) already fired

    @classmethod
    def parse(cls, spec: str) -> "FaultInjector":
        faults = []
        for entry in filter(None, (e.strip() for e in spec.split(","))):
            try:
                kind, rest = entry.split(":", 1)
                rest, _, value = rest.partition("=")
                seed, _, at = rest.partition("@")
                fault = Fault(kind, int(seed), int(at or 1), float(value or 2.0))
            except ValueError:
                raise ValueError(f"{ENV_VAR}: bad entry {entry!r}; expected kind:seed[@n][=value]") from None
            if fault.kind not in KINDS or fault.at < 1:
                raise ValueError(f"{ENV_VAR}: bad entry {entry!r}; kinds are {', '.join(KINDS)}, n >= 1")
            faults.append(fault)
        return cls(faults)

    @classmethod
    def from_env(cls) -> "FaultInjector | None":
        """The injector ``LLMD_FAULT_INJECT`` describes, or None when it is unset or empty."""
        spec = os.environ.get(ENV_VAR, "")
        return cls.parse(spec) if spec.strip() else None

    def install(self, engine) -> "FaultInjector":
        """Arm on ``engine``: set ``engine.faults`` (``engine.faults = None`` disarms) and wrap
        its runner's sampler once (``nan``; the wrapper asks ``engine.faults`` at each call)."""
        engine.faults = self
        if not isinstance(engine.runner.sampler, _NanSampler):
            engine.runner.sampler = _NanSampler(engine.runner.sampler, engine)
        return self

    # ---- hooks (engine thread) ------------------------------------------------------
    def _due(self, kind: str, req, at: int) -> Fault | None:
        for f in self.faults:
            if (f.kind == kind and f.seed == req.sampling_params.seed and f.at == at
                    and (kind, req.request_id) not in self._done):
                self._done.add((kind, req.request_id))
                self.fired[kind] += 1
                return f
        return None

    def check_postprocess(self, req) -> None:
        """Raise :class:`InjectedFault` if ``req`` (its new token appended) is a victim."""
        if self._due("postprocess", req, req.num_output_tokens):
            raise InjectedFault(f"injected postprocessing fault for {req.request_id}")

    def check_step(self, requests) -> None:
        """After the scheduler's update: hang, or raise :class:`InjectedFault` for the step,
        when one of the step's sampling ``requests`` is a victim."""
        for req in requests:
            hang = self._due("hang", req, req.num_output_tokens)
            if hang:
                time.sleep(hang.value)
        for req in requests:
            if self._due("step", req, req.num_output_tokens):
                raise InjectedFault(f"injected step fault (at {req.request_id})")

    def kv_pull_fault(self, req) -> Fault | None:
        """The ``kv_*`` fault due at a pull of ``req``'s pinned KV, or None."""
        for kind in ("kv_expire", "kv_pull_cut", "kv_pull_stall"):
            fault = self._due(kind, req, 1)
            if fault is not None:
                return fault
        return None

    def nan_rows(self, requests) -> list[int]:
        """Rows of ``requests`` (about to sample their next token) whose logits become NaN."""
        return [b for b, req in enumerate(requests) if self._due("nan", req, req.num_output_tokens + 1)]


class _NanSampler:
    """Wraps a :class:`~llmd.daemon.core.sampler.Sampler`: the victims' rows become NaN first."""

    def __init__(self, inner, engine):
        self.inner, self.engine = inner, engine

    def __call__(self, logits, requests):
        injector = self.engine.faults
        rows = injector.nan_rows(requests) if injector is not None else []
        if rows:
            logits = logits.clone()
            logits[rows] = float("nan")
        return self.inner(logits, requests)

    def __getattr__(self, name):
        return getattr(self.inner, name)
