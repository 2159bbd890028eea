"""pdserve.testbed.kvfaults: fault plans are installed by tests, never read by production code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.testbed.kvfaults import PLAN_ENV, FaultPlan, PlannedFaults, child_env

# A child that builds a zmq sender and says what faults it carries.
PROBE = """
import json
from pdserve.kv_transfer import KVLayout, create_sender
layout = KVLayout(model_id="m", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=4,
                  block_size=2)
sender = create_sender("zmq", layout)
faults = sender.faults
print(json.dumps(None if faults is None else [type(faults).__name__, faults.plan.drop]))
"""


def probe(env: dict[str, str | None]) -> object:
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_child_given_child_env_gets_the_plan_in_every_sender() -> None:
    assert probe(child_env("drop=0.5,seed=3")) == ["PlannedFaults", 0.5]


def test_production_senders_ignore_the_variable_without_the_test_bed() -> None:
    assert probe({PLAN_ENV: "drop=1"}) is None


def test_plans_parse_and_bad_ones_are_refused() -> None:
    plan = FaultPlan.parse("drop=0.1,corrupt=0.2,delay=0.3,delay_s=0.01,seed=7,targets=a;b")
    assert plan == FaultPlan(0.1, 0.2, 0.3, 0.01, 7, frozenset({"a", "b"}))
    for bad in ("drop", "lose=0.1", "drop=x"):
        with pytest.raises(ValueError):
            FaultPlan.parse(bad)
    with pytest.raises(ValueError):
        child_env("drop")
    assert child_env(None) == {PLAN_ENV: None}


def test_planned_faults_follow_the_plan() -> None:
    always = PlannedFaults(FaultPlan(drop=1.0, corrupt=1.0))
    assert always.drop("x") and always.corrupt("x")
    targeted = PlannedFaults(FaultPlan(targets=frozenset({"bad"})))
    assert targeted.corrupt("bad") and not targeted.corrupt("good") and not targeted.drop("bad")
    a, b = (PlannedFaults(FaultPlan(drop=0.5, seed=4)) for _ in range(2))
    assert [a.drop("x") for _ in range(20)] == [b.drop("x") for _ in range(20)]  # seeded
