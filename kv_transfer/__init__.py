"""KV connectors: move KV pages from a prefill node's cache blocks into a decode node's blocks.

Pick a connector by name (`zmq`, `nccl`, `shm`) with `create_sender` / `create_receiver`; a node
holds its end of the data plane in a `ranks.KVPort`.
"""

from pdserve.common.wire.payloads import KVLayout
from pdserve.kv_transfer.base import (
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    TransferError,
    TransferResult,
    TransferTimeout,
    connector_names,
    create_receiver,
    create_sender,
)

__all__ = [
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "LayoutMismatchError",
    "TransferError",
    "TransferResult",
    "TransferTimeout",
    "connector_names",
    "create_receiver",
    "create_sender",
]
