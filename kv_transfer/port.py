"""One process's end of the KV data plane: `KVPort` holds the connector, the layout both ends
agree on, the cluster's keys, and its senders or its receiver (each tensor-parallel rank of a
node holds one, inside its `ranks.RankKV`)."""

from __future__ import annotations

import torch

from pdserve.common.process import host_id
from pdserve.common.wire.payloads import KVLayout
from pdserve.common.wire.security import CurveKeys
from pdserve.kv_transfer.base import (
    KVReceiver,
    KVSender,
    check_available,
    create_receiver,
    create_sender,
)


class KVPort:
    """One node's KV connector: its name, the cache layout both ends must agree on (the digest
    a node registers with), and the cluster's CurveZMQ keys for every socket it opens.

    A prefill node keeps one connected sender per decode node (`sender`, `drop`); a decode node
    binds one receiver (`listen`) and registers its `endpoint`.
    """

    def __init__(
        self,
        connector: str,
        layout: KVLayout,
        curve: CurveKeys | None = None,
        connect_timeout: float = 10.0,
        advertise_host: str = "127.0.0.1",
    ) -> None:
        check_available(connector)
        self.advertise_host = advertise_host  # how other hosts reach this node's sockets
        self.host_id = host_id()
        self.connector = connector
        self.layout = layout
        self.digest = layout.digest()
        self.curve = curve
        self.connect_timeout = connect_timeout
        self.senders: dict[str, KVSender] = {}  # receiver endpoint -> connected sender
        self._instances: dict[str, str] = {}  # receiver endpoint -> the process behind it
        self.receiver: KVReceiver | None = None

    @property
    def endpoint(self) -> str:
        """Where senders connect ("" on a node that binds no receiver)."""
        return self.receiver.endpoint if self.receiver is not None else ""

    def listen(
        self, kv_caches: list[torch.Tensor], host: str, port: int, fence_timeout: float = 30.0
    ) -> KVReceiver:
        """Bind the receiver that writes arriving pages into `kv_caches` (`port=0`: any free);
        `fence_timeout` is nixl's (see nixl_receiver)."""
        assert self.receiver is None, "a KV port binds one receiver"
        opts = {"fence_timeout": fence_timeout} if self.connector == "nixl" else {}
        self.receiver = create_receiver(
            self.connector, self.layout, kv_caches, host=host, port=port, curve=self.curve, **opts
        )
        self.receiver.advertise(self.advertise_host)
        return self.receiver

    def sender(self, endpoint: str, instance: str = "") -> KVSender:
        """The connected sender to the receiver at `endpoint`. The first call handshakes and
        raises what `KVSender.connect` raises (a layout mismatch included). `instance` names
        the receiving process: when another one now listens at the same address (a restart on
        a fixed port), the old connection is dropped and a new one handshakes; the transport
        would otherwise reconnect silently to a receiver that never heard our hello."""
        if instance and self._instances.get(endpoint, instance) != instance:
            self.drop(endpoint)
        if instance:
            self._instances[endpoint] = instance
        sender = self.senders.get(endpoint)
        if sender is None:
            # nccl's gloo pair listens on this node's own address, which the peer dials.
            opts = {"bind_host": self.advertise_host} if self.connector == "nccl" else {}
            sender = create_sender(self.connector, self.layout, curve=self.curve, **opts)
            sender.connect(endpoint, self.connect_timeout)
            self.senders[endpoint] = sender
        return sender

    def poll(self) -> None:
        """Let every sender take its receiver's messages (a prefill node's loop calls it)."""
        for sender in self.senders.values():
            sender.poll()

    def drop(self, endpoint: str) -> None:
        """Close the sender to `endpoint` (its connection broke); the next `sender` reconnects."""
        sender = self.senders.pop(endpoint, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        """Close every sender and the receiver; idempotent."""
        for endpoint in list(self.senders):
            self.drop(endpoint)
        if self.receiver is not None:
            self.receiver.close()
