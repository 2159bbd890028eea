"""A node's settings apart from the engine's: how it joins the cluster and how KV moves.

Pure Python (no torch): the CLI module that builds it is imported by the router too.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

from pdserve.common.options import option
from pdserve.common.tracing import TracingConfig

# The connectors `kv_transfer.create_sender` / `create_receiver` know (a test keeps them equal).
KV_CONNECTORS = ("zmq", "nccl", "shm", "nixl")
NETWORK, RELIABILITY, SECURITY = "network", "cluster and reliability", "security"
PARALLEL = "parallelism"


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Every setting of one node beyond model, cache and scheduler, for every role; each but
    connect_timeout is the flag of its name (--router for router_addrs).

    A colocated node ignores the KV fields; only a decode node binds `host:kv_port`.
    """

    router_addrs: tuple[str, ...] = option(
        MISSING,
        NETWORK,
        "control address of a router; repeat it for several routers (the node registers "
        "with each and answers each one's requests)",
        flag="--router",
        action="append",
        required=True,
        metavar="HOST:PORT",
        type=str,
    )
    node_id: str | None = option(
        None, RELIABILITY, "id in the router (default: role-random)", type=str
    )
    heartbeat_interval: float = option(0.5, RELIABILITY, "seconds between reports")
    lease_timeout: float = option(
        10.0,
        RELIABILITY,
        "free and fail a request the router has not renewed for this long (s)",
    )
    max_queued_requests: int = option(
        1024,
        RELIABILITY,
        "requests held at once (queued, running, reserved); beyond: refused with 503",
    )
    drain_timeout: float = option(
        30.0,
        RELIABILITY,
        "on SIGTERM, finish held requests for up to this long (s), then fail the rest",
    )
    stall_timeout: float = option(
        60.0,
        RELIABILITY,
        "stop proving liveness when the node loop made no progress for this long (s)",
    )
    curve_dir: str | None = option(
        None,
        SECURITY,
        "CurveZMQ keys (`pdserve keygen DIR`): authenticate and encrypt every link "
        "(default: no encryption)",
        type=str,
    )
    kv_connector: str = option("zmq", NETWORK, "how KV pages travel P -> D", choices=KV_CONNECTORS)
    host: str = option("127.0.0.1", NETWORK, "address to bind KV and health sockets on")
    advertise_host: str | None = option(
        None,
        NETWORK,
        "the address other hosts reach this node's KV sockets at (default: --host; when "
        "--host is a wildcard such as 0.0.0.0, the address of the interface that reaches the "
        "first router). Routers check it at registration",
        type=str,
    )
    kv_port: int = option(0, NETWORK, "KV receiver port (0: a free one)")
    health_port: int = option(
        0,
        NETWORK,
        "HTTP port of /live, /ready and /metrics for probes and autoscalers (0: none)",
    )
    tensor_parallel_size: int = option(
        1,
        PARALLEL,
        "processes (ranks) that hold the model, each a share of its heads and KV cache "
        "(torch.distributed: gloo on CPU, NCCL on CUDA)",
        aliases=("-tp",),
        metavar="N",
    )
    threads_per_rank: int | None = option(
        None,
        PARALLEL,
        "torch threads of each rank (default: the machine's threads shared evenly)",
        type=int,
        metavar="T",
    )
    tp_workers: str = option(
        "local",
        PARALLEL,
        "local: this process starts its worker ranks on this host; external: it waits for "
        "them (`pdserve tp-worker --leader HOST:TP_PORT --rank R` on other hosts)",
        choices=("local", "external"),
    )
    tp_port: int = option(
        0, PARALLEL, "the ranks' rendezvous port on --host (0: a free one; external: required)"
    )
    connect_timeout: float = 10.0  # s for a KV handshake with a decode node (no flag)
    # Its flags are TracingConfig's own (the router's too): `cli.add_node_args` adds them.
    tracing: TracingConfig = field(default_factory=TracingConfig)
    kv_fence_timeout: float = option(
        30.0,
        NETWORK,
        "nixl, decode node: how long a cancelled transfer's blocks wait for prefill nodes "
        "that do not confirm they stopped writing (then they are freed and those nodes dropped)",
        metavar="S",
    )

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
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_workers == "external" and not self.tp_port:
            raise ValueError("--tp-workers external needs a fixed --tp-port for its workers")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
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
        for name in ("kv_port", "health_port", "tp_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")

    def kv_options(self, model_id: str, role: str, advertise_host: str) -> dict[str, Any]:
        """The options of a KV-moving role's end on each of its ranks (`RankKV`'s keywords):
        `model_id` the checkpoint's fingerprint, `advertise_host` how peers reach this host."""
        return {
            "connector": self.kv_connector,
            "model_id": model_id,
            "role": role,
            "curve_dir": self.curve_dir,
            "host": self.host,
            "port": self.kv_port,
            "advertise_host": advertise_host,
            "connect_timeout": self.connect_timeout,
            "fence_timeout": self.kv_fence_timeout,
        }


def is_wildcard(host: str) -> bool:
    """Whether binding `host` means every interface (no peer can connect to it as given)."""
    return host in ("0.0.0.0", "::", "*", "[::]", "")
