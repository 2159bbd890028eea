"""The commands a node's rank 0 sends to every rank's KV end (`ranks.RankKV`), and their
answers: typed messages of the KV ranks plane (`common.wire.ranks`). `KVGroup` sends them; a
worker rank decodes them strictly and refuses anything else.

Endpoints are a decode group's receivers, rank 0 first (`Reserved.kv_endpoints`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.common.wire.messages import Message
from pdserve.common.wire.payloads import FirstToken
from pdserve.common.wire.ranks import Count, Done, RankCommand, RankPlane

KV_RANKS = RankPlane("KV ranks")
command = KV_RANKS.command


@dataclass(frozen=True, slots=True)
class EndpointIs(Message):
    TYPE: ClassVar[str] = "kvr.endpoint_is"
    endpoint: str  # "" on a rank that binds no receiver


@dataclass(frozen=True, slots=True)
class SliceDone(Message):
    """One slice of a transfer finished on a decode rank; `first` is the request's first
    token, as the sender handed it over."""

    TYPE: ClassVar[str] = "kvr.slice_done"
    xfer_id: str
    ok: bool
    error: str
    first: FirstToken


@dataclass(frozen=True, slots=True)
class Finished(Message):
    TYPE: ClassVar[str] = "kvr.finished"
    slices: tuple[SliceDone, ...]


@dataclass(frozen=True, slots=True)
class Released(Message):
    TYPE: ClassVar[str] = "kvr.released"
    xfer_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Failures(Message):
    """Decode groups (by their rank 0 endpoint) a rank's sends to broke since the last ask."""

    TYPE: ClassVar[str] = "kvr.failures"
    why: dict[str, str]


# -- decode side --------------------------------------------------------------------------------


@command
@dataclass(frozen=True, slots=True)
class Endpoint(RankCommand):
    TYPE: ClassVar[str] = "kvr.endpoint"
    REPLY: ClassVar[type[Message]] = EndpointIs


@command
@dataclass(frozen=True, slots=True)
class Expect(RankCommand):
    """Expect the rank's slices of `xfer_id` from a prefill group at TP `src_tp` into
    `block_ids`; answers how many."""

    TYPE: ClassVar[str] = "kvr.expect"
    REPLY: ClassVar[type[Message]] = Count
    xfer_id: str
    block_ids: tuple[int, ...]
    src_tp: int


@command
@dataclass(frozen=True, slots=True)
class Cancel(RankCommand):
    TYPE: ClassVar[str] = "kvr.cancel"
    REPLY: ClassVar[type[Message]] = Done
    xfer_id: str


@command
@dataclass(frozen=True, slots=True)
class TakeFinished(RankCommand):
    TYPE: ClassVar[str] = "kvr.take_finished"
    REPLY: ClassVar[type[Message]] = Finished


@command
@dataclass(frozen=True, slots=True)
class TakeReleased(RankCommand):
    TYPE: ClassVar[str] = "kvr.take_released"
    REPLY: ClassVar[type[Message]] = Released


@command
@dataclass(frozen=True, slots=True)
class BytesReceived(RankCommand):
    TYPE: ClassVar[str] = "kvr.bytes_received"
    REPLY: ClassVar[type[Message]] = Count


# -- prefill side -------------------------------------------------------------------------------


@command
@dataclass(frozen=True, slots=True)
class BytesSent(RankCommand):
    TYPE: ClassVar[str] = "kvr.bytes_sent"
    REPLY: ClassVar[type[Message]] = Count


@command
@dataclass(frozen=True, slots=True)
class Connect(RankCommand):
    """Handshake with every decode rank this rank sends to; `instance` names the decode
    process (a restarted one gets a new handshake)."""

    TYPE: ClassVar[str] = "kvr.connect"
    REPLY: ClassVar[type[Message]] = Done
    endpoints: tuple[str, ...]
    instance: str


@command
@dataclass(frozen=True, slots=True)
class TakeFailures(RankCommand):
    TYPE: ClassVar[str] = "kvr.take_failures"
    REPLY: ClassVar[type[Message]] = Failures


@command
@dataclass(frozen=True, slots=True)
class SendDone(RankCommand):
    """End the rank's slices of `xfer_id`, handing over the request's first token."""

    TYPE: ClassVar[str] = "kvr.send_done"
    REPLY: ClassVar[type[Message]] = Done
    endpoints: tuple[str, ...]
    xfer_id: str
    first: FirstToken


@command
@dataclass(frozen=True, slots=True)
class Abandon(RankCommand):
    TYPE: ClassVar[str] = "kvr.abandon"
    REPLY: ClassVar[type[Message]] = Done
    endpoints: tuple[str, ...]
    xfer_id: str


@command
@dataclass(frozen=True, slots=True)
class Drop(RankCommand):
    """Close the connections to a decode group (one broke); the next Connect reconnects."""

    TYPE: ClassVar[str] = "kvr.drop"
    REPLY: ClassVar[type[Message]] = Done
    endpoints: tuple[str, ...]


@command
@dataclass(frozen=True, slots=True)
class PollSenders(RankCommand):
    TYPE: ClassVar[str] = "kvr.poll_senders"
    REPLY: ClassVar[type[Message]] = Done


# -- a step's layer hook ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shipment:
    """One request's pages of one step: from `src` blocks here to `dst` blocks of the decode
    group at `endpoints`, as transfer `xfer_id`."""

    endpoints: tuple[str, ...]
    xfer_id: str
    src: tuple[int, ...]
    dst: tuple[int, ...]


@KV_RANKS.register
@dataclass(frozen=True, slots=True)
class ShipKV(Message):
    """What every prefill rank sends after each layer of a step (`RankKV.layer_hook`): no
    command (nothing answers it), it rides the step itself."""

    TYPE: ClassVar[str] = "kvr.ship"
    shipments: tuple[Shipment, ...]
