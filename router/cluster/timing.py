"""One backend request's time to its first token, taken apart into stages.

Each stage is a duration on one process's monotonic clock: the router's own (its queue, the
decode reservation's round trips), the computing node's (its queue, the prefill), the decode
node's (the KV transfer, its admission, its first step); the nodes send theirs with the first
token they compute (`Tokens.stages`). No two instants of different clocks are compared.

`node_inbox` is the router's dispatch -> first token less the computing node's taken -> first
token: two durations, each on one clock. It is the prompt's wait unread in the node's control
socket (a node reads its messages between engine steps, so a prompt that comes during a step
waits for its end: 1.4 s at 8 requests at once on the loaded 2-core box, against 1-13 ms for
the messages' way there and back), and the messages' way. With it the TTFT stages add up to
the router's TTFT.

In pdserve the prefill node streams the first token at once; the KV transfer's tail, the decode
node's admission and its first step come after it and delay the second token. They are
reported as the hand-off stages, beside the TTFT stages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.common.wire.messages import Tokens
from pdserve.common.wire.payloads import StageTimes

TTFT_STAGES = ("router_queue", "decode_reservation", "node_inbox", "prefill_queue", "prefill")
HANDOFF_STAGES = ("kv_transfer", "decode_admission", "first_decode_step")


@dataclass(slots=True)
class RequestTiming:
    """Router-side stamps of one backend request (monotonic s; 0: not yet) and the nodes' stage
    times. The backend writes it as the request goes; the HTTP layer reads it at the end.
    Stamps after the first token (a failover's new attempt) leave the TTFT stages as they were:
    they are those of the attempt that produced it."""

    arrival: float = field(default_factory=time.monotonic)
    traceparent: str | None = None  # the client's W3C trace context, when it sent one
    reserving: float = 0.0  # seconds spent waiting for decode nodes' reservations
    dispatched: float = 0.0  # the computing node was sent the prompt
    first_token: float = 0.0  # the first token reached the router's request stream
    computed: StageTimes | None = None  # from the node that computed the prompt
    received: StageTimes | None = None  # from the decode node its KV went to
    cached_tokens: int = 0  # prompt tokens a node had cached (its first message's count)

    def reserved(self, seconds: float) -> None:
        if not self.first_token:
            self.reserving += seconds

    def dispatch(self) -> None:
        if not self.first_token:
            self.dispatched = time.monotonic()

    def note(self, msg: Tokens) -> None:
        """A node's message on its way to the client: its stages, the first token's time."""
        stages = msg.stages
        if stages is not None:
            if stages.kv_transfer or stages.admission or stages.first_step:
                self.received = self.received or stages
            elif not self.first_token:
                self.computed = stages
        if msg.token_ids and not self.first_token:
            self.first_token = time.monotonic()
        self.cached_tokens = max(self.cached_tokens, msg.cached_tokens)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival if self.first_token else 0.0

    def ttft_stages(self) -> dict[str, float] | None:
        """The stages before the first token (None until the computing node's are in)."""
        c = self.computed
        if c is None or not self.dispatched:
            return None
        router = self.dispatched - self.arrival
        away = (self.first_token or self.dispatched) - self.dispatched
        inbox = max(0.0, away - c.queue - c.prefill)  # see the module's docstring
        values = (router - self.reserving, self.reserving, inbox, c.queue, c.prefill)
        return dict(zip(TTFT_STAGES, values, strict=True))

    def handoff_stages(self) -> dict[str, float] | None:
        """The decode node's stages (None: no KV was sent, or not yet)."""
        r = self.received
        if r is None:
            return None
        values = (r.kv_transfer, r.admission, r.first_step)
        return dict(zip(HANDOFF_STAGES, values, strict=True))

    def metrics(self) -> dict[str, object]:
        """What a request that asked for its metrics gets back (`"metrics"`), in seconds."""
        return {
            "time_to_first_token": self.ttft or None,
            "ttft_stages": self.ttft_stages(),
            "handoff_stages": self.handoff_stages(),
        }
