"""Rank commands: what a tensor-parallel node's rank 0 asks of every rank's agent (the node's
part beside each rank's model runner, e.g. its KV connector end), as typed messages on a plane
of their own, like the control and KV data planes.

An agent names its `PLANE` (a `RankPlane`: every command it takes, each registered with the
message type it answers with) and its `handlers()` (command type -> the method that answers
it). A rank decodes each command frame strictly with its agent's plane; a frame it cannot
decode, a command of no handler, or a handler that raised is answered with `Refused` and a
reason, and the worker stays up: rank 0 decides what a refusal means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pdserve.common.wire.messages import Message, Plane, ProtocolError, encode


@dataclass(frozen=True, slots=True)
class RankCommand(Message):
    """Base of a command rank 0 sends to every rank; each rank answers with a `REPLY`."""

    REPLY: ClassVar[type[Message]]


@dataclass(frozen=True, slots=True)
class Done(Message):
    """The answer to a command that returns nothing but that it ran."""

    TYPE: ClassVar[str] = "rank.done"


@dataclass(frozen=True, slots=True)
class Refused(Message):
    """A rank's answer to a command it could not run: undecodable, unknown, or its handler
    raised (`reason` says which, and why)."""

    TYPE: ClassVar[str] = "rank.refused"
    reason: str


@dataclass(frozen=True, slots=True)
class Count(Message):
    """An answer that is one number (a count of slices, of bytes)."""

    TYPE: ClassVar[str] = "rank.count"
    n: int


class RankCommandError(RuntimeError):
    """A worker rank refused a command or answered it with the wrong type. A RuntimeError on
    purpose: a node treats it as the failure of what it asked for (a KV send, say), as it
    treats its own rank's failure of the same command."""


class RankPlane(Plane):
    """The commands one kind of rank agent takes and the answers it gives: `command` registers
    a command with its reply type; every rank plane carries `Done`, `Refused` and `Count`."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        for cls in (Done, Refused, Count):
            self.register(cls)

    def command(self, cls: type[RankCommand]) -> type[RankCommand]:
        """Register `cls` and its reply type (once); a decorator."""
        self.register(cls)
        if cls.REPLY.TYPE not in self.types:
            self.register(cls.REPLY)
        return cls

    def reply(self, command: RankCommand, frame: bytes, rank: int) -> Message:
        """Rank `rank`'s answer to `command`, of the command's REPLY type; RankCommandError,
        naming the rank and the command, when the rank refused or answered something else."""
        try:
            answer = self.decode(frame)
        except ProtocolError as exc:
            answer = Refused(f"undecodable answer: {exc}")
        if isinstance(answer, command.REPLY):
            return answer
        why = answer.reason if isinstance(answer, Refused) else f"answered {answer.TYPE}"
        raise RankCommandError(f"tensor-parallel rank {rank}: {command.TYPE} failed: {why}")


# A rank agent's table: each command type it takes -> the method that answers it.
Handlers = Mapping[type[RankCommand], Callable[[Any], Message]]


class RankAgent(Protocol):
    """What a node's per-rank part provides to take commands (see the module docstring)."""

    PLANE: ClassVar[RankPlane]

    def handlers(self) -> Handlers: ...


def answer(plane: RankPlane | None, handlers: Handlers, frame: bytes) -> bytes:
    """A rank's encoded answer to one command frame: its handler's reply, or `Refused` saying
    why not (no agent here, a frame its plane refuses, a command of no handler, a handler
    that raised)."""
    if plane is None:
        return encode(Refused("this rank has no agent to take commands"))
    try:
        command = plane.decode(frame)
    except ProtocolError as exc:
        return encode(Refused(f"malformed command: {exc}"))
    handler = handlers.get(type(command))  # type: ignore[arg-type]
    if handler is None:
        return encode(Refused(f"{command.TYPE} is no command of the {plane.name} plane"))
    try:
        return encode(handler(command))
    except Exception as exc:  # noqa: BLE001 - answered: the worker stays up, rank 0 decides
        return encode(Refused(f"{type(exc).__name__}: {exc}"))
