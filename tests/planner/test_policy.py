"""The planner's policy against the peers' failure modes (issue 41's acceptance). Each check is
a function of the policy class; each test runs it on `Policy` (must hold) and on a naive policy
that repeats a peer's mistake (must not), so no check here is one that cannot fail."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from pdserve.planner.actions import DRAIN, FLIP, START, STOP, actions_for
from pdserve.planner.config import PlannerConfig
from pdserve.planner.policy import Policy
from pdserve.planner.snapshot import NodeView, TtftShares

from .plant import (
    CONFIG,
    PREFILL_RATE,
    ColdStartBlind,
    Load,
    NaNBlind,
    NeedsSamples,
    NoHysteresis,
    QueueBlind,
    QueueTwice,
    RequestRate,
    StageBlind,
    WaitsForReady,
    counts,
    nodes,
    run,
    snapshot,
)


def grows_prefill_on_queue_alone(cls: type[Policy]) -> bool:
    """Arrivals two prefill nodes compute at half their rate, TTFT still within its SLO, and a
    queue of 40k prompt tokens (4 s of two nodes' work, past the 1 s queue budget)."""
    load = Load(arrival=8.0, prompt=1000.0, queued=40_000.0)
    view = nodes(2, 2)
    decision = cls(CONFIG).decide(snapshot(load, view, 0.0), 0.0)
    return decision.decided and decision.prefill > 2  # type: ignore[operator]


def test_queue_wait_alone_grows_prefill() -> None:
    assert grows_prefill_on_queue_alone(Policy)
    assert not grows_prefill_on_queue_alone(QueueBlind)


def growth_on_a_late_ttft(cls: type[Policy], shares: TtftShares, queued: float) -> tuple[int, int]:
    """The pools' growth (prefill, decode) from 1P1D on a light load (no pool short of its
    rate) whose p90 TTFT is 3x its SLO, spent as `shares` tell, with `queued` prompt tokens
    waiting at the instant of the reading."""
    load = Load(arrival=1.0, prompt=1000.0, queued=queued)
    snap = snapshot(load, nodes(1, 1), 0.0, ttft_p90=3 * CONFIG.ttft_slo, ttft_shares=shares)
    decision = cls(CONFIG).decide(snap, 0.0)
    return decision.prefill - 1, decision.decode - 1  # type: ignore[operator]


def test_the_ttft_stage_waited_on_picks_the_pool_that_grows() -> None:
    """Waiting for prefill nodes grows prefill even when no prompt waits at the reading's
    instant; waiting for a decode node's reservation grows decode, not prefill; a TTFT that
    is the prefill's own compute grows neither."""
    prefill_wait, decode_wait = TtftShares(0.8, 0.05), TtftShares(0.1, 0.7)
    computing = TtftShares(0.1, 0.0)
    assert growth_on_a_late_ttft(Policy, prefill_wait, queued=0.0) == (1, 0)
    assert growth_on_a_late_ttft(Policy, decode_wait, queued=2000.0) == (0, 1)
    assert growth_on_a_late_ttft(Policy, computing, queued=2000.0) == (0, 0)
    assert growth_on_a_late_ttft(StageBlind, prefill_wait, queued=0.0) == (0, 0)
    assert growth_on_a_late_ttft(StageBlind, decode_wait, queued=2000.0) == (1, 0)


def prefill_while_nodes_start(cls: type[Policy]) -> int:
    """1 ready and 3 starting prefill nodes (a cold start: 60 s each), arrivals 3 nodes
    compute, a queue of 100k prompt tokens and TTFT over its SLO: the prefill count asked."""
    view = nodes(1, 2) + tuple(NodeView(f"s{i}", "prefill", False, 0.0) for i in range(3))
    load = Load(arrival=2.0 * PREFILL_RATE / 1000.0, prompt=1000.0, queued=100_000.0)
    snap = snapshot(load, view, 10.0, ttft_p90=4 * CONFIG.ttft_slo)
    return cls(CONFIG).decide(snap, 10.0).prefill  # type: ignore[return-value]


def test_nodes_still_starting_are_not_added_to_for_the_queue_they_will_drain() -> None:
    assert prefill_while_nodes_start(Policy) == 4
    assert prefill_while_nodes_start(ColdStartBlind) > 4


def prefill_when_started_nodes_serve(cls: type[Policy]) -> int:
    """A 40k-token queue grows prefill from 1 (to 5: drained within the 1 s budget); 70 s on
    the 5 serve and 60k tokens wait, which they drain in 2 s at their spare rate, long before
    a node asked for then would serve: the prefill count asked then."""
    policy, load = cls(CONFIG), Load(arrival=8.0, prompt=1000.0, queued=40_000.0)
    first = policy.decide(snapshot(load, nodes(1, 2), 0.0), 0.0)
    assert first.prefill == 5, first.describe()
    later = replace(load, queued=60_000.0)
    return policy.decide(snapshot(later, nodes(5, 2), 70.0), 70.0).prefill  # type: ignore[return-value]


def test_nodes_grown_for_a_queue_ask_no_more_for_it_once_they_serve() -> None:
    assert prefill_when_started_nodes_serve(Policy) == 5
    assert prefill_when_started_nodes_serve(QueueTwice) > 5


def prefill_on_a_climb(config: PlannerConfig) -> int:
    """Arrivals climbing by 2 requests/s (2,000 prompt tokens/s) every 10 s for 200 s: the
    prefill count asked at the top (38-40 requests/s: 6-7 nodes' worth at `util_high`)."""
    loads = [Load(arrival=2.0 + 2.0 * i, prompt=1000.0) for i in range(20)]
    return run(Policy(config), loads, start=(1, 1))[-1][0]


def test_a_climb_is_planned_for_a_node_start_ahead() -> None:
    ahead, behind = prefill_on_a_climb(CONFIG), prefill_on_a_climb(replace(CONFIG, lead=0.0))
    assert ahead > behind, (ahead, behind)


def changes_at_the_boundary(cls: type[Policy]) -> int:
    """A constant load at one prefill node's growth threshold, measured with 4% noise, for 60
    intervals: how often the prefill count changes."""
    rng = random.Random(7)
    at_threshold = PREFILL_RATE * CONFIG.util_high / 1000.0  # requests/s of 1000 tokens
    loads = [Load(at_threshold * (1 + rng.gauss(0, 0.04)), 1000.0) for _ in range(60)]
    history = [p for p, _ in run(cls(CONFIG), loads, start=(1, 1))]
    return sum(a != b for a, b in zip(history, history[1:]))


def test_no_oscillation_at_the_boundary_under_constant_load() -> None:
    assert changes_at_the_boundary(Policy) <= 1
    assert changes_at_the_boundary(NoHysteresis) >= 4


def intervals_to_minimum_when_idle(cls: type[Policy]) -> int | None:
    """Busy at 6P/4D, then idle (nothing arrives, nothing measured): the intervals until both
    pools are at their minimum, None if not within ten."""
    busy = Load(arrival=40.0, prompt=1000.0)
    idle = [Load(arrival=0.0, prompt=0.0, output=0.0)] * 10
    policy, view = cls(CONFIG), nodes(6, 4)
    policy.decide(snapshot(busy, view, 0.0), 0.0)
    for i, load in enumerate(idle, 1):
        now = i * CONFIG.interval
        snap = snapshot(load, view, now, prefill_rate=None, decode_rate=None, ttft_p90=None)
        decision = policy.decide(snap, now)
        if decision.decided:
            view = nodes(decision.prefill, decision.decode)  # type: ignore[arg-type]
        if counts(view) == (CONFIG.min_prefill, CONFIG.min_decode):
            return i
    return None


def test_scales_down_to_the_minimum_within_two_intervals_of_going_idle() -> None:
    steps = intervals_to_minimum_when_idle(Policy)
    assert steps is not None and steps <= 2, steps
    assert intervals_to_minimum_when_idle(NeedsSamples) is None


BAD_FIGURES = [
    {"arrival_rate": math.nan},
    {"mean_prompt_tokens": math.nan},
    {"queued_prompt_tokens": math.inf},
    {"kv_usage": math.nan},
    {"arrival_rate": -1.0},
    {"prefill_rate": math.nan},
    {"prefill_rate": None},
    {"decode_rate": math.nan},
    {"at": -100.0},  # measured 100 s ago: stale
]


def decides_on(cls: type[Policy], bad: dict[str, object]) -> bool:
    """Whether any of three decisions on the bad figures is made (none should be), or the
    policy fails on them."""
    policy, view, load = cls(CONFIG), nodes(3, 3), Load(arrival=10.0, prompt=1000.0)
    made = []
    for i in range(3):
        now = i * CONFIG.interval
        figures = {k: (now + v if k == "at" else v) for k, v in bad.items()}
        try:
            made.append(policy.decide(snapshot(load, view, now, **figures), now).decided)
        except (OverflowError, ValueError):
            return True
    return any(made)


@pytest.mark.parametrize(
    "bad", BAD_FIGURES, ids=lambda b: "-".join(f"{k}={v}" for k, v in b.items())
)
def test_nan_absent_or_stale_figures_make_no_decision(bad: dict[str, object]) -> None:
    assert not decides_on(Policy, bad)
    assert decides_on(NaNBlind, bad) or "rate" in next(iter(bad))


def test_a_bad_figure_changes_nothing_and_says_why() -> None:
    view = nodes(3, 3)
    decision = Policy(CONFIG).decide(
        snapshot(Load(10.0, 1000.0), view, 0.0, arrival_rate=math.nan), 0.0
    )
    assert (decision.prefill, decision.decode) == (None, None)
    assert actions_for(decision, view) == ()
    assert "NaN" in decision.describe()


def replaces_a_node_that_never_becomes_ready(cls: type[Policy]) -> bool:
    """Two prefill nodes needed; one was started at 0 and never becomes ready. Before the
    start timeout the planner still decides (a load step grows prefill to 3); after it, the
    dead node is stopped and a node started in its place."""
    config = PlannerConfig(start_timeout=60.0)
    policy = cls(config)
    dead = NodeView("p-dead", "prefill", ready=False, started_at=0.0)
    view = (*nodes(1, 2), dead)
    two, three = Load(arrival=10.0, prompt=1000.0), Load(arrival=17.0, prompt=1000.0)
    early = policy.decide(snapshot(three, view, 30.0), 30.0)
    if not early.decided or early.prefill != 3:
        return False
    late = policy.decide(snapshot(two, view, 100.0), 100.0)
    kinds = [(a.kind, a.node_id) for a in actions_for(late, view)]
    return (STOP, "p-dead") in kinds and (START, None) in kinds and late.prefill == 2


def test_a_node_that_never_becomes_ready_does_not_stall_the_planner() -> None:
    assert replaces_a_node_that_never_becomes_ready(Policy)
    assert not replaces_a_node_that_never_becomes_ready(WaitsForReady)


def ratio_after_prompts_grow(cls: type[Policy]) -> tuple[float, float]:
    """P:D after 10 intervals of 1K-token prompts, then after 10 of 8K (4 requests/s, 256
    answer tokens each)."""
    loads = [Load(4.0, 1024.0)] * 10 + [Load(4.0, 8192.0)] * 10
    history = run(cls(CONFIG), loads, start=(1, 1))
    return history[9][0] / history[9][1], history[-1][0] / history[-1][1]


def test_the_p_to_d_ratio_follows_the_prompt_length() -> None:
    short, long = ratio_after_prompts_grow(Policy)
    assert long >= 4 * short, (short, long)
    naive_short, naive_long = ratio_after_prompts_grow(RequestRate)
    assert naive_long < 4 * naive_short


def test_a_role_flip_is_cheaper_than_a_start_and_a_drain() -> None:
    view = nodes(1, 4)
    decision = Policy(CONFIG).decide(snapshot(Load(4.0, 8192.0), view, 0.0), 0.0)
    acts = actions_for(decision, view)
    assert decision.prefill > 1 and decision.decode < 4  # type: ignore[operator]
    assert FLIP in {a.kind for a in acts}
    assert not {START, DRAIN} <= {a.kind for a in acts}, acts


def test_bounds_hold_whatever_the_load() -> None:
    config = PlannerConfig(max_prefill=3, min_decode=2, max_nodes=4)
    decision = Policy(config).decide(snapshot(Load(100.0, 8192.0), nodes(1, 2), 0.0), 0.0)
    assert decision.prefill <= 3 and decision.decode >= 2  # type: ignore[operator]
    assert decision.prefill + decision.decode <= 4  # type: ignore[operator]


@pytest.mark.parametrize(
    "given",
    [{"util_low": 0.9}, {"ttft_slo": 0.0}, {"min_prefill": 70}, {"queue_share": 2.0}],
)
def test_bad_settings_are_refused(given: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PlannerConfig(**given)  # type: ignore[arg-type]
