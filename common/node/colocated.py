"""The colocated ("both") role: prefill and decode in one engine."""

from __future__ import annotations

from pdserve.common.engine.request import Request
from pdserve.common.node.loop import EngineNode
from pdserve.common.node.membership import Handler
from pdserve.common.wire.messages import Message, Prefill


class ColocatedNode(EngineNode):
    """Role "both": prefill and decode in one engine (vLLM-style mixed batches). A Prefill
    brings a whole request: the node runs it to its end itself."""

    role = "both"
    reports_prefixes = True

    def handlers(self) -> dict[type[Message], Handler]:
        return {**super().handlers(), Prefill: self.admitting(self.queue)}

    def queue(self, _: Prefill, request: Request) -> None:
        self.engine.scheduler.add_request(request)
