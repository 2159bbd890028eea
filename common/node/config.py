"""A node's settings apart from the engine's: how it joins the cluster and how KV moves.

Pure Python (no torch): the CLI module that builds it is imported by the router too.
"""

from __future__ import annotations

from dataclasses import dataclass

# The connectors `kv_transfer.create_sender` / `create_receiver` know (a test keeps them equal).
KV_CONNECTORS = ("zmq", "nccl", "shm", "nixl")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Every setting of one node beyond model, cache and scheduler, for every role.

    A colocated node ignores the KV fields; only a decode node binds `host:kv_port`.
    """

    router_addrs: tuple[str, ...]  # HOST:PORT of each router's control socket
    node_id: str | None = None  # None: the role plus a random suffix
    heartbeat_interval: float = 0.5  # s between load reports (and liveness proofs)
    lease_timeout: float = 10.0  # s a request the router stopped renewing is kept
    max_queued_requests: int = 1024  # requests held at once; beyond that, refused
    drain_timeout: float = 30.0  # s to finish held requests after SIGTERM
    stall_timeout: float = 60.0  # s without loop progress before liveness proofs stop
    curve_dir: str | None = None  # CurveZMQ keys for every link (None: plain)
    kv_connector: str = "zmq"
    host: str = "127.0.0.1"  # where a decode node binds its KV receiver (and health server)
    advertise_host: str | None = None  # how other hosts reach it (None: from host, see cli)
    kv_port: int = 0  # 0: a free port
    health_port: int = 0  # HTTP /live, /ready, /metrics (0: none)
    connect_timeout: float = 10.0  # s for a KV handshake with a decode node
    # nixl: s a cancelled transfer's blocks wait for prefill nodes that do not answer
    kv_fence_timeout: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.router_addrs, str):  # one router, given as its address
            object.__setattr__(self, "router_addrs", (self.router_addrs,))
        object.__setattr__(self, "router_addrs", tuple(self.router_addrs))
        if not self.router_addrs:
            raise ValueError("a node needs at least one router address")
        for addr in self.router_addrs:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"router address must be HOST:PORT, got {addr!r}")
        if len(set(self.router_addrs)) != len(self.router_addrs):
            raise ValueError(f"a router is given twice: {list(self.router_addrs)}")
        if self.node_id is not None and not self.node_id.strip():
            raise ValueError("node id must not be empty")
        for name in (
            "heartbeat_interval",
            "lease_timeout",
            "stall_timeout",
            "connect_timeout",
            "kv_fence_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv connector must be one of {KV_CONNECTORS}: {self.kv_connector!r}")
        if not self.host:
            raise ValueError("KV host must not be empty")
        if self.advertise_host is not None and (
            not self.advertise_host or is_wildcard(self.advertise_host)
        ):
            raise ValueError(
                f"advertise host must be an address other hosts can reach, got "
                f"{self.advertise_host!r}"
            )
        for name in ("kv_port", "health_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")


def is_wildcard(host: str) -> bool:
    """Whether binding `host` means every interface (no peer can connect to it as given)."""
    return host in ("0.0.0.0", "::", "*", "[::]", "")
