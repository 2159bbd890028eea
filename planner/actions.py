"""From a `Decision` to what changes: start a node, drain one, flip one's role (drain, switch,
register again: cheaper than a cold start when one pool grows as the other shrinks), or stop
one that never became ready. Pure: the simulator and the supervisor carry the actions out."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.planner.policy import Decision
from pdserve.planner.snapshot import DECODE, PREFILL, NodeView

START, DRAIN, FLIP, STOP = "start", "drain", "flip", "stop"


@dataclass(frozen=True, slots=True)
class Action:
    """One change: `kind` on `node_id` (None for a start); `role` is the role a started or
    flipped node takes, or the role of a drained or stopped one."""

    kind: str
    role: str
    node_id: str | None = None


def actions_for(decision: Decision, nodes: tuple[NodeView, ...]) -> tuple[Action, ...]:
    """The fewest changes that reach the decision's counts: flips first, then starts and
    drains; a drain takes a node still starting before a ready one, the newest first."""
    roles = {n.node_id: n.role for n in nodes}
    out = [Action(STOP, roles[i], i) for i in decision.stop]
    if not decision.decided:
        return tuple(out)
    live = [n for n in nodes if not n.draining and n.node_id not in decision.stop]
    spare = {r: _drain_order([n for n in live if n.role == r]) for r in (PREFILL, DECODE)}
    gap = {
        PREFILL: decision.prefill - len(spare[PREFILL]),  # type: ignore[operator]
        DECODE: decision.decode - len(spare[DECODE]),  # type: ignore[operator]
    }
    for grows, shrinks in ((PREFILL, DECODE), (DECODE, PREFILL)):
        flips = min(gap[grows], -gap[shrinks]) if gap[grows] > 0 else 0
        out += [Action(FLIP, grows, spare[shrinks].pop(0)) for _ in range(max(flips, 0))]
        gap[grows] -= max(flips, 0)
        gap[shrinks] += max(flips, 0)
    for role in (PREFILL, DECODE):
        out += [Action(START, role) for _ in range(gap[role])]
        out += [Action(DRAIN, role, spare[role].pop(0)) for _ in range(-gap[role])]
    return tuple(out)


def _drain_order(pool: list[NodeView]) -> list[str]:
    return [n.node_id for n in sorted(pool, key=lambda n: (n.ready, -n.started_at))]
