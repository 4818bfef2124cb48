"""``llmd serve --kv-role``: one daemon's part in prefill/decode disaggregation.

Roles (vLLM's ``kv_role`` values ``kv_both`` / ``kv_producer`` / ``kv_consumer``):

* ``both`` (the default): no disaggregation; ``kv_transfer_params`` is accepted and ignored,
  every request is prefilled and decoded here (llmd's behaviour before the roles existed).
* ``producer``: answers ``do_remote_decode`` requests by prefilling, pinning the prompt's blocks
  for ``pin_timeout`` seconds (or until pulled) and returning their ``kv_transfer_params``;
  serves the pull (:mod:`.tcp`) on its TCP listener.
* ``consumer``: answers ``do_remote_prefill`` requests by pulling the KV from the producer the
  params name and decoding; on any failure it computes the prefill itself (logged, counted).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from llmd.daemon.core.errors import LlmdError

KV_ROLES = ("both", "producer", "consumer")
DEFAULT_PIN_TIMEOUT_S = 60.0
DEFAULT_PULL_TIMEOUT_S = 30.0


#: ``llmd serve`` flag → the one ``--kv-role`` that reads it (any other role would ignore it)
ROLE_OF_FLAG = {"--kv-advertise-host": "producer", "--kv-pin-timeout": "producer",
                "--kv-producer": "consumer", "--kv-pull-timeout": "consumer"}


def check_role_flags(role: str, given: set[str]) -> None:
    """Refuse a P/D flag the user gave (``given``: flag names) that ``role`` does not read.

    Raises:
        LlmdError: the first such flag, naming the role it needs.
    """
    for flag, needs in ROLE_OF_FLAG.items():
        if flag in given and role != needs:
            raise LlmdError(f"{flag} is for --kv-role {needs} only (this daemon is --kv-role {role}, "
                            "which would ignore it)")


@dataclass
class KVTransferConfig:
    """The daemon's disaggregation settings (``ServerState.kv_transfer``).

    Attributes:
        role: one of :data:`KV_ROLES`.
        host, port: what a producer advertises as ``remote_host`` / ``remote_port`` (its TCP
            listener, or ``--kv-advertise-host`` when it binds a wildcard address).
        api_key: the key a consumer sends when it pulls (the daemon's own; never logged).
        pin_timeout: seconds a producer keeps unpulled KV pinned.
        pull_timeout: seconds a consumer's whole pull may take before it computes instead.
        engine_id: ``remote_engine_id``: random per daemon start.
        connector: the consumer's :class:`~.connector.KVConnector` (None: :class:`~.tcp.TcpPullConnector`).
        fingerprint: the consumer's engine fingerprint, once fetched (``handshake.py``).
        producers: the consumer's allow-list of producer ``host:port`` addresses
            (``--kv-producer``; the pull sends this daemon's key there); empty = loopback
            producers only (:meth:`allows`).
    """

    role: str = "both"
    host: str | None = None
    port: int | None = None
    api_key: str | None = field(default=None, repr=False)
    pin_timeout: float = DEFAULT_PIN_TIMEOUT_S
    pull_timeout: float = DEFAULT_PULL_TIMEOUT_S
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    connector: object | None = None
    fingerprint: dict | None = None
    producers: tuple[str, ...] = ()

    def allows(self, host: str, port: int) -> bool:
        """Whether a consumer may pull from (and so send its key to) ``host:port``: one of
        :attr:`producers`, or with none given a loopback address (``127.0.0.0/8``, ``::1``,
        ``localhost``). A client's ``kv_transfer_params`` never chooses a host outside them."""
        if self.producers:
            return f"{host}:{port}" in self.producers
        import ipaddress

        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host.strip("[]")).is_loopback
        except ValueError:
            return False

    def check(self) -> "KVTransferConfig":
        """Validate. Raises LlmdError: unknown role, a producer without a TCP address to
        advertise, a non-positive timeout."""
        if self.role not in KV_ROLES:
            raise LlmdError(f"--kv-role must be one of {', '.join(KV_ROLES)}, got {self.role!r}")
        if self.role == "producer" and (self.port is None or not self.host):
            raise LlmdError("--kv-role producer needs the TCP listener (--port) its consumers pull from")
        if self.role == "producer" and self.host in ("0.0.0.0", "::", ""):
            raise LlmdError(f"--kv-role producer on the wildcard address {self.host!r}: name the address consumers "
                            "reach with --kv-advertise-host")
        for p in self.producers:
            host, _, port = p.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise LlmdError(f"--kv-producer must be HOST:PORT, got {p!r}")
        for name in ("pin_timeout", "pull_timeout"):
            if not getattr(self, name) > 0:
                raise LlmdError(f"--kv-{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.role == "consumer" and self.connector is None:
            from llmd.daemon.serving.kv_transfer.tcp import TcpPullConnector

            self.connector = TcpPullConnector(self.api_key)
        return self
