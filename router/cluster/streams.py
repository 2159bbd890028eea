"""The router's state of one request in flight on the cluster, and the failover note that
re-routes it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdserve.common.wire.messages import Error, Tokens
from pdserve.router.backend import GenerateRequest


@dataclass(frozen=True, slots=True)
class Failover:
    """Queued into a stream when a node it depends on died, stalled or refused it.

    kind "prefill": only the prefill node is lost and no token reached the client yet, so the
    decode node keeps its reservation and another prefill node fills it. kind "resume": run the
    rest elsewhere from the prompt plus the tokens already streamed.
    """

    kind: str
    lost: tuple[str, ...]  # node ids not to route this request to again
    detached: tuple[str, ...]  # node ids the request left (each gets an Abort)
    why: str


@dataclass(slots=True)
class Stream:
    """Router-side state of one request in flight. Its queue holds the nodes' messages as
    decoded (the HTTP layer consumes them as they are), and failover notes."""

    request: GenerateRequest
    queue: asyncio.Queue[Tokens | Error | Failover] = field(default_factory=asyncio.Queue)
    prefill_node: str = ""
    decode_node: str = ""
    got_first: bool = False
    admitted: bool = False  # the decode node has the whole KV: the prefill node is done
    failed: bool = False  # ended by an error or abort: the other node may still hold blocks
    early: list[Tokens] = field(default_factory=list)  # decode tokens that beat the first
    generated: list[int] = field(default_factory=list)  # tokens handed to the client
    failovers: int = 0
    attempt: int = 0  # bumped when the request starts over on other nodes
    lost: set[str] = field(default_factory=set)  # nodes this request left behind
    first_at: float = 0.0  # when the prefill node's first token came (monotonic; 0: not yet)
    local_prefill: bool = False  # prefilled on its decode node, first token not yet seen

    @property
    def wire_id(self) -> str:
        """The id nodes know this attempt by: late messages of an earlier attempt (even from
        the same node) can never be taken for this one's."""
        rid = self.request.request_id
        return rid if self.attempt == 0 else f"{rid}~{self.attempt}"

    def nodes(self) -> set[str]:
        return {self.prefill_node, self.decode_node} - {""}
