"""The KV connector interface: how a consumer gets a producer's pinned KV (vLLM's
``KVConnectorBase_V1`` in small: one call, whole prompt, pull model).

A connector turns the producer's ``kv_transfer_params`` (:class:`RemoteKV`) into a
:class:`~llmd.daemon.core.kv_transfer.KVPayload` of plain CPU tensors; the engine thread writes
it into the consumer's blocks. llmd's own transport is :mod:`.tcp` (an authenticated binary
pull over the producer's TCP listener); another transport (NCCL, RDMA, shared memory) replaces
it by implementing :class:`KVConnector` and being set as ``KVTransferConfig.connector``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from llmd.daemon.core.kv_transfer import KVPayload


class KVPullError(Exception):
    """The pull failed (connection refused or cut, timeout, refused by the producer, bad
    bytes); its message says how. The consumer then computes the prefill itself."""


@dataclass(frozen=True)
class RemoteKV:
    """Where a request's pinned KV lives (from the producer's ``kv_transfer_params``).

    Attributes:
        host, port: the producer's TCP listener (``remote_host``, ``remote_port``).
        transfer_id: the unguessable id that alone names the pin (``llmd_transfer_id``).
        engine_id, request_id: ``remote_engine_id``, ``remote_request_id`` (for logs).
    """

    host: str
    port: int
    transfer_id: str
    engine_id: str | None = None
    request_id: str | None = None


class KVConnector(Protocol):
    """What a consumer needs from a transport."""

    async def pull(self, remote: RemoteKV, max_bytes: int, timeout: float) -> KVPayload:
        """The pinned KV of ``remote`` (the producer frees its pin when it serves it).

        Args:
            max_bytes: refuse (before reading it) a payload announcing more data than this.
            timeout: seconds for the whole pull.
        Raises:
            KVPullError: any failure (never a partial payload). A cancelled pull
                (``asyncio.CancelledError``, the client went away) closes its connection.
        """
        ...

    async def close(self) -> None:
        """Release the connector's connections."""
        ...
