"""llmd.daemon.client: talking to a daemon over its socket.

``client`` (:class:`Client`, :class:`AsyncClient`), ``spawn`` (ensure a daemon runs, lock
probe, wait for its exit), ``chat`` (the ``llmd chat`` REPL). Imports only ``protocol`` and
``core.errors`` from the daemon (``chat``'s in-process backend takes an engine it is handed).
"""

from llmd.daemon.client.client import ApiResponseError, AsyncClient, Client, DaemonStarting, DaemonUnavailable

__all__ = ["ApiResponseError", "AsyncClient", "Client", "DaemonStarting", "DaemonUnavailable"]
