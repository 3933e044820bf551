"""Configuration of one KV transport endpoint (prefill KVSender or decode KVReceiver)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pdserve.fsm import RoomDeadlines
from pdserve.tls import TLSConfig
from pdserve.transport.faults import FaultPlan


def new_incarnation() -> str:
    """A fresh incarnation id: new at every process start, so a restarted peer is recognisable."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class TransportConfig:
    """Everything the transport needs, passed down explicitly (no globals, no env reads).

    ``engine_id`` is stable across restarts; ``incarnation`` is not. A peer is identified by both
    (``"<engine_id>@<incarnation>"``, also the NIXL agent name), so messages from a previous life
    of a peer can be told apart and rejected.
    """

    engine_id: str
    incarnation: str = field(default_factory=new_incarnation)
    # The model identity a peer must share (checked at registration with the page layout).
    model_name: str = ""
    model_fingerprint: str = ""  # pdserve.transport.layout.model_fingerprint of the checkpoint
    weights_fingerprint: str = ""  # pdserve.model.fingerprint.weights_fingerprint of it
    bootstrap_host: str = "127.0.0.1"  # prefill only: where the bootstrap server listens
    bootstrap_port: int = 8998  # prefill only; 0 = ephemeral (read KVSender.bootstrap_port)
    heartbeat_interval_s: float = 1.0  # a peer is declared lost after 2 missed intervals
    abort_quarantine_s: float = 5.0  # fence for destination pages of a dead sender
    connect_timeout_s: float = 2.0  # refused connections for this long -> bootstrap_error
    request_timeout_s: float = 5.0  # one bootstrap HTTP request
    deadlines: RoomDeadlines = field(default_factory=RoomDeadlines)
    checksum: bool = False  # sender attaches a page checksum, receiver verifies before Success
    faults: FaultPlan | None = None
    max_chunk_pages: int = 0  # pages per WRITE (one notification each); 0 = whole room at once
    max_room_pages: int = 1 << 16  # bound on a room's page list on the wire
    max_recent_aborts: int = 4096  # sender memory of aborted room ids (for late first contacts)
    # How long a room's WRITE waits for the prefill forward that wrote its pages to finish on
    # the device (its KVReady marker): past it the room fails "transfer_error: kv not ready".
    kv_ready_timeout_s: float = 10.0
    # Shared secret of the bootstrap port (``--bootstrap-token``): the prefill refuses every
    # bootstrap request without it (401), the decode sends it. None: no authentication.
    bootstrap_token: str | None = None
    # TLS (--ssl-*): a prefill's bootstrap server serves HTTPS, a decode calls bootstrap ports
    # over HTTPS (verified against ca_certs), both when certfile is set (pdserve/tls.py).
    tls: TLSConfig = field(default_factory=TLSConfig)

    def __post_init__(self) -> None:
        if not self.engine_id or "@" in self.engine_id:
            raise ValueError(f"engine_id must be non-empty and contain no '@': {self.engine_id!r}")
        if not self.incarnation or "@" in self.incarnation:
            raise ValueError(f"incarnation must be non-empty, no '@': {self.incarnation!r}")
        for name in (
            "heartbeat_interval_s",
            "connect_timeout_s",
            "request_timeout_s",
            "kv_ready_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.abort_quarantine_s < 0:
            raise ValueError(f"abort_quarantine_s must be >= 0, got {self.abort_quarantine_s}")
        if self.max_chunk_pages < 0 or self.max_room_pages < 1:
            raise ValueError("max_chunk_pages must be >= 0 and max_room_pages >= 1")
        if self.bootstrap_token is not None and not self.bootstrap_token.strip():
            raise ValueError("bootstrap_token must be non-empty (or None for no token)")
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port out of range: {self.bootstrap_port}")

    @property
    def peer_key(self) -> str:
        """``"<engine_id>@<incarnation>"``: this endpoint's identity and NIXL agent name."""
        return peer_key(self.engine_id, self.incarnation)

    @property
    def peer_lost_after_s(self) -> float:
        """Silence after which a peer is declared lost (two heartbeat intervals)."""
        return 2.0 * self.heartbeat_interval_s


def peer_key(engine_id: str, incarnation: str) -> str:
    """The identity of one life of an engine, used as ``Room.peer`` and as NIXL agent name."""
    return f"{engine_id}@{incarnation}"
