"""The torch.distributed rendezvous a group of processes meets at: the tensor-parallel ranks of
a node (`common.engine.tensor_parallel`) and the gloo/NCCL pair of the nccl KV connector
(`kv_transfer.nccl_connector`) both serve theirs with `listening_store`. It sits under both
(not in `common.model`, which a connector has no business importing)."""

from __future__ import annotations

import datetime
import socket

import torch.distributed


def listening_store(
    host: str, port: int, world_size: int | None, timeout: datetime.timedelta
) -> torch.distributed.TCPStore:
    """A rendezvous store served on exactly `host` (TCPStore alone listens on every interface).
    The store owns the listening socket and closes it when it is destroyed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)
    bound = listener.getsockname()[1]
    return torch.distributed.TCPStore(
        host,
        bound,
        world_size,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
