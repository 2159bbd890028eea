"""`--request-log FILE`: one JSON line per finished request, for `pdserve bench replay`.

A line holds what a replay needs and what an operator asks of one request, and no text: when
it arrived (epoch s), its prompt's and answer's lengths, its prompt's full blocks as chained
block hashes (the router's `BlockHashes` at the block size of the node that computed it; 16 hex
digits each: two prompts share a hash exactly where they share every token up to that block's
end), the prompt tokens a node had cached, its time to first token and its stages
(router/cluster/timing.py), end-to-end time, the nodes chosen, its failovers and outcome.

Lines are written as requests end, each whole and flushed; a write that fails (disk full) is
logged once and loses only the log, never the request.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.router.cluster.streams import Stream

log = logging.getLogger(__name__)

HASH_HEX = 16  # 64 bits of each chained block hash: equal prefixes stay equal, lines short


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    """One finished request as its log line holds it (times in seconds)."""

    arrival: float  # epoch s
    prompt_tokens: int
    output_tokens: int
    block_size: int
    hash_ids: list[str]  # the prompt's full blocks, chained (see the module's docstring)
    cached_tokens: int
    ttft: float | None
    e2e: float
    ttft_stages: dict[str, float] | None
    handoff_stages: dict[str, float] | None
    prefill_node: str
    decode_node: str
    failovers: int
    outcome: str  # finished, failed or abandoned


class RequestLog:
    """The open log file of one router; `write` one line per finished request."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)

    def write(self, entry: LoggedRequest) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(asdict(entry), separators=(",", ":")) + "\n")
            self._file.flush()
        except OSError as exc:
            log.error("request log %s: %s; no more lines are written", self.path, exc)
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def epoch_of(monotonic_s: float) -> float:
    """A monotonic reading of this process as epoch seconds (now's offset between the two)."""
    return round(time.time() - (time.monotonic() - monotonic_s), 3)


def hash_ids(hashes: list[bytes]) -> list[str]:
    return [h.hex()[:HASH_HEX] for h in hashes]


def logged(stream: Stream, outcome: str, block_size: int) -> LoggedRequest:
    """The log line of a request that ended (`outcome`); its prompt hashed in blocks of
    `block_size` (the computing node's)."""
    timing, prompt = stream.request.timing, stream.request.prompt_token_ids
    return LoggedRequest(
        arrival=epoch_of(timing.start),
        prompt_tokens=len(prompt),
        output_tokens=len(stream.generated),
        block_size=block_size,
        hash_ids=hash_ids(stream.hashes.of(block_size, len(prompt))),
        cached_tokens=timing.cached_tokens,
        ttft=timing.ttft or None,
        e2e=time.monotonic() - timing.start,
        ttft_stages=timing.ttft_stages(),
        handoff_stages=timing.handoff_stages(),
        prefill_node=stream.prefill_node,
        decode_node=stream.decode_node,
        failovers=stream.failovers,
        outcome=outcome,
    )
