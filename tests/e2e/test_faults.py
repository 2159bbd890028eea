"""Fault injection under a 100-request load, real processes (2 prefill + 2 decode nodes).

Every request must end complete and correct (token for token against the in-process engine)
or with an explicit error; never a 200 with wrong tokens. Afterwards every surviving node
reports every block free or cached. Figures from the same scenarios, run by
scripts/reliability_report.py, are in docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve.testbed import faults as fh
from pdserve.testbed import kvfaults
from pdserve.tiny_model import make_tiny_model
from tests.e2e.test_disaggregated import assert_reports_clean
from tests.kv_transfer.helpers import needs_nixl

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("faults") / "m", max_position=2048))


@pytest.fixture(scope="module")
def loads(model_dir) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Three loads of different prompts, (prompts, reference answers) each: scenarios run one
    after another on one deployment each get prompts no node has cached yet (a cached prompt's
    prefill is over before a fault aimed at it could hit). One reference run for all three."""
    sets = [fh.make_prompts(VOCAB, seed=seed) for seed in range(3)]
    wants = fh.reference(model_dir, [p for prompts in sets for p in prompts])
    n = len(sets[0])
    return [(prompts, wants[i * n : (i + 1) * n]) for i, prompts in enumerate(sets)]


@pytest.fixture(scope="module")
def load(loads):
    return loads[0]


def check(run: fh.Run, cluster, min_ok: int) -> None:
    summary = run.summary()
    assert run.count("wrong") == 0, [o for o in run.outcomes if o.status == "wrong"][:3]
    assert run.count("ok") >= min_ok, summary
    reports = fh.wait_clean(cluster)  # the survivors' (a killed node answers nothing)
    assert_reports_clean(reports, len(reports))


def kill(name: str):
    def fault(cluster) -> None:
        cluster.procs[name].kill()  # SIGKILL: no goodbye

    return fault


def test_a_stalled_node_then_a_killed_prefill_node_then_a_killed_decode_node(model_dir, loads):
    """Three faults, one after another, on one 2P2D deployment (each scenario's failovers are
    the router's count during it). SIGSTOP of a decode node for 3 s, past the router's
    heartbeat timeout: its requests fail over, and it is back in the rotation once it answers
    again. A prefill node killed mid-transfer: failover re-prefills whatever it held. A decode
    node killed mid-decode: streams resume on the other one after the tokens already sent,
    with no gap and no repeat. Each time the survivors finish every answer, equal to the
    reference."""
    prompts, wants = loads[0]
    with fh.cluster_for(model_dir) as c:

        def stall(cluster) -> None:
            pid = cluster.procs["decode1"].pid
            os.kill(pid, signal.SIGSTOP)
            time.sleep(3.0)  # past the router's heartbeat timeout: it fails the node over
            os.kill(pid, signal.SIGCONT)

        # 0.1 s into the load: the router goes on routing requests to decode1 until its
        # heartbeat timeout, so some wait on it, however fast the nodes are.
        run = fh.run_scenario("SIGSTOP decode 3 s", c, prompts, wants, stall, 0.1)
        check(run, c, min_ok=len(prompts))
        assert run.failovers > 0
        everyone = {"prefill0", "prefill1", "decode0", "decode1"}
        assert fh.wait_members(c, everyone) == everyone

        survivors = {"prefill0", "prefill1", "decode0", "decode1"}
        for role, (prompts, wants) in (("prefill", loads[1]), ("decode", loads[2])):
            victim = f"{role}0"
            # A prefill node 0.3 s into the load, while the router still hands it requests
            # (it holds some only briefly: too briefly to see it through the integrity
            # check); a decode node while it holds requests (5 or more).
            when = None if role == "prefill" else fh.holding(victim, at_least=5)
            name = f"kill -9 {role}"
            run = fh.run_scenario(name, c, prompts, wants, kill(victim), 0.3, when=when)
            check(run, c, min_ok=len(prompts))
            assert run.failovers > 0, role
            survivors.discard(victim)
            assert fh.wait_members(c, survivors) == survivors


def set_child_env(monkeypatch: pytest.MonkeyPatch, plan: str) -> None:
    for key, value in kvfaults.child_env(plan).items():
        monkeypatch.setenv(key, value)


def test_dropped_corrupted_and_delayed_kv_frames(model_dir, load, monkeypatch):
    """Every KV frame may be dropped, corrupted or delayed, in one run (each kind's detection
    is also tested on its own per connector: tests/kv_transfer/test_connectors.py)."""
    prompts, wants = load
    plan = "drop=0.02,corrupt=0.02,delay=0.1,delay_s=0.02,seed=1"
    set_child_env(monkeypatch, plan)  # the node processes' senders get the plan
    with fh.cluster_for(model_dir, num_prefill=1, num_decode=1) as c:
        run = fh.run_scenario(f"KV frames: {plan}", c, prompts, wants)
        # Damaged transfers are retried (a few times at most); none is decoded from.
        check(run, c, min_ok=len(prompts) * 9 // 10)
        assert run.failovers > 0


def test_overload_at_ten_times_the_queue(model_dir, load):
    """100 requests at once against a router that queues 10: the rest get 503 with
    Retry-After at once, every admitted one finishes correctly, router memory stays flat."""
    prompts, wants = load
    extra = ("--max-queued-requests", "10")
    with fh.cluster_for(model_dir, extra, num_prefill=1, num_decode=1) as c:
        router = c.procs["router"].pid
        before = fh.rss_mib(router)
        runs = [fh.run_scenario(f"overload {i}", c, prompts, wants) for i in range(3)]
        growth = fh.rss_mib(router) - before
        for run in runs:
            refused = [o for o in run.outcomes if o.status == "error"]
            assert all(o.detail == "HTTP 503" for o in refused), {o.detail for o in refused}
            assert run.count("ok") >= 10 and len(refused) >= 50, run.summary()
            check(run, c, min_ok=10)
        assert growth < 64, f"router RSS grew {growth:.0f} MiB over 300 requests"


def test_clients_that_disconnect_then_sigterm_drains_a_decode_node(model_dir, loads):
    """On one 1P2D deployment: 30% of the clients hang up after two chunks (every other
    answer is right, nothing stays held); then SIGTERM to a decode node: it takes nothing new,
    finishes what it holds (what it cannot finish in its drain timeout fails over), exits 0;
    requests go on to the other decode node."""
    prompts, wants = loads[0]
    with fh.cluster_for(model_dir, num_prefill=1, num_decode=2) as c:
        run = fh.run_scenario("30% disconnect", c, prompts, wants, disconnect_fraction=0.3)
        assert run.count("disconnected") >= 20
        check(run, c, min_ok=len(prompts) - run.count("disconnected"))

        def term(cluster) -> None:
            cluster.procs["decode0"].send_signal(signal.SIGTERM)

        prompts, wants = loads[1]  # uncached: decode0 holds them while the prefill runs
        holds = fh.holding("decode0")
        run = fh.run_scenario("SIGTERM decode", c, prompts, wants, term, 0.2, when=holds)
        assert c.procs["decode0"].wait(timeout=30) == 0
        check(run, c, min_ok=len(prompts))


# -- the nixl connector: the scenarios that touch a KV transfer, run where the extra is
# installed (CI installs it). A cancelled transfer's blocks stay fenced on the decode node
# until the prefill nodes confirm they stopped writing; a dead one never does, so the fence
# times out (3 s here) before the blocks come back.


NIXL = {"kv_connector": "nixl", "node_extra": ("--kv-fence-timeout", "3")}


@needs_nixl
def test_nixl_kill_a_prefill_node_mid_transfer_then_a_decode_node(model_dir, load):
    prompts, wants = load

    def kill_both(cluster) -> None:
        kill("prefill0")(cluster)  # its WRITEs into the decode nodes stop mid-transfer
        time.sleep(1.2)
        kill("decode0")(cluster)

    with fh.cluster_for(model_dir, **NIXL) as c:
        name = "nixl: kill -9 prefill, then decode"
        run = fh.run_scenario(name, c, prompts, wants, kill_both, 0.3)  # as above
        check(run, c, min_ok=len(prompts))
        assert run.failovers > 0
        assert set(c.integrity()) == {"prefill1", "decode1"}


@needs_nixl
def test_nixl_dropped_and_corrupted_writes(model_dir, load, monkeypatch):
    prompts, wants = load
    set_child_env(monkeypatch, "drop=0.03,corrupt=0.03,seed=4")
    with fh.cluster_for(model_dir, num_prefill=1, num_decode=1, **NIXL) as c:
        run = fh.run_scenario("nixl: dropped and corrupted WRITEs", c, prompts, wants)
        # A damaged transfer fails its checksum on the decode node and is retried.
        check(run, c, min_ok=len(prompts) * 9 // 10)
        assert run.failovers > 0
