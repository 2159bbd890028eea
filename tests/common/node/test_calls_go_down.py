"""Calls go one way on a node: from the loop to the roles and the engine, never back.

One request runs through a prefill and a decode node (their handlers, steps and KV I/O, in this
process) under a profile hook that records each call from one pdserve folder into another. The
folders must form no cycle: a role reporting a stage to the loop's clock, or the engine calling
the node's step hook, is a way back (a zigzag of `scripts/request_path.py`, which measures the
same on real processes; docs/architecture.md "Each remaining zigzag").
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import pdserve.common
from tests.prefill_node.test_prefill_node import finish_on_decode, nodes, start

__all__ = ["nodes"]  # the fixture, used by name

REPO = Path(pdserve.common.__file__).resolve().parents[1]
OUTSIDE = ("tests", "scripts", ".venv")


def folder(code_file: str, known: dict[str, str | None]) -> str | None:
    """The pdserve folder a code object's file is in (None: not pdserve source)."""
    if code_file not in known:
        path = Path(code_file).resolve()
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else None
        ok = rel is not None and rel.suffix == ".py" and rel.parts[0] not in OUTSIDE
        known[code_file] = str(rel.parent) if ok else None
    return known[code_file]


@contextmanager
def folder_calls() -> Iterator[dict[tuple[str, str], str]]:
    """Every call from one pdserve folder into another while open, on every thread:
    (caller folder, callee folder) -> the first such call, "caller -> callee"."""
    calls: dict[tuple[str, str], str] = {}
    known: dict[str, str | None] = {}

    def profile(frame: FrameType, event: str, _: object) -> None:
        if event != "call" or (callee := folder(frame.f_code.co_filename, known)) is None:
            return
        caller = frame.f_back  # through library frames (threads, zmq) to pdserve's
        while caller is not None and folder(caller.f_code.co_filename, known) is None:
            caller = caller.f_back
        if caller is None:
            return
        edge = (folder(caller.f_code.co_filename, known) or "", callee)
        if edge[0] != callee and edge not in calls:
            calls[edge] = f"{caller.f_code.co_qualname} -> {frame.f_code.co_qualname}"

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def ways_back(calls: dict[tuple[str, str], str]) -> list[str]:
    """Each call whose callee's folder reaches its caller's folder again (a cycle)."""
    graph: dict[str, set[str]] = {}
    for a, b in calls:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            here = todo.pop()
            if here == goal:
                return True
            if here not in seen:
                seen.add(here)
                todo.extend(graph.get(here, ()))
        return False

    return [f"{a} -> {b}: {how}" for (a, b), how in calls.items() if reaches(b, a)]


def test_one_request_through_both_roles_calls_no_folder_back(nodes) -> None:
    router, prefill, decode_ = nodes
    with folder_calls() as calls:
        start(router, prefill, decode_, "r", list(range(3, 60)))  # 2 chunks of at most 40
        while "r" in prefill.dests:
            prefill.step()
        got = finish_on_decode(router, decode_, "r")
    assert len(got) == 5
    assert ("common/node", "prefill_node") in calls and ("common/node", "decode_node") in calls
    assert ("common/node", "common/engine") in calls
    assert ways_back(calls) == []
