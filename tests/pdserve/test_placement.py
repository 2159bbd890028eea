"""CPU placement of a local deployment: the plan by the work, the flag, and the cores the
started children read back (`os.sched_getaffinity` of every thread)."""

from __future__ import annotations

import os

import httpx
import pytest

from pdserve.local_cluster import LocalCluster
from pdserve.placement import plan, threads_env
from pdserve.serve import build_parser, cluster_from_args

ENGINE = ["--block-size", "16", "--num-blocks", "64", "--max-model-len", "256"]
ENGINE += ["--dtype", "float32"]


def test_decode_nodes_get_a_quarter_of_the_cores_at_least_one_each() -> None:
    two = plan([0, 1], ["p0"], ["d0"], [])
    assert two == {"d0": (1,), "p0": (0,), "router": (0,)}
    eight = plan(range(8), ["p0", "p1"], ["d0"], [])
    assert eight == {"d0": (6, 7), "p0": (0, 1, 2), "p1": (3, 4, 5), "router": tuple(range(6))}
    many = plan(range(4), ["p0"], ["d0", "d1"], [])  # one core each beats the quarter
    assert many == {"d0": (2,), "d1": (3,), "p0": (0, 1), "router": (0, 1)}


def test_colocated_nodes_split_evenly_and_the_routers_float() -> None:
    assert plan([4, 5, 6], [], [], ["b0", "b1"]) == {"b0": (4, 5), "b1": (6,)}


def test_nothing_is_pinned_without_a_core_for_each_node() -> None:
    assert plan([0, 1], ["p0", "p1"], ["d0"], []) == {}
    assert plan([0], [], [], ["b0"]) == {}


def test_a_pinned_node_runs_no_more_threads_than_its_cores() -> None:
    assert threads_env((0, 1), {})["OMP_NUM_THREADS"] == "2"
    assert threads_env((0, 1), {"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "2"
    assert threads_env((0, 1, 2), {"OMP_NUM_THREADS": "1"})["OMP_NUM_THREADS"] == "1"


def _cluster(argv: list[str]) -> LocalCluster:
    p = build_parser()
    return cluster_from_args(p, p.parse_args([*argv, "--port", "1", "--control-port", "2"]))


def test_the_serve_flag_reaches_the_cluster() -> None:
    assert _cluster(["--model", "M"]).placement == "auto"
    cluster = _cluster(["--model", "M", "--cpu-placement", "off"])
    assert cluster.placement == "off" and cluster.cores() == {}
    with pytest.raises(SystemExit):
        _cluster(["--model", "M", "--cpu-placement", "half"])
    with pytest.raises(ValueError, match="cpu placement"):
        LocalCluster("M", placement="half")


def _threads_cores(pid: int) -> set[tuple[int, ...]]:
    """The cores of each thread of pid, as a set of distinct core sets."""
    tids = os.listdir(f"/proc/{pid}/task")
    return {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tids}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="1P1D placement needs two cores")
@pytest.mark.parametrize("placement", ["auto", "off"])
def test_started_children_run_on_their_cores(tiny_model_dir, placement: str) -> None:
    mine = tuple(sorted(os.sched_getaffinity(0)))
    cpus = mine[:2]
    with LocalCluster(str(tiny_model_dir("llama")), 1, 1, engine_args=ENGINE,
                      placement=placement, cpus=cpus) as c:  # fmt: skip
        body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "temperature": 0}
        assert httpx.post(c.url + "/v1/completions", json=body, timeout=60).status_code == 200
        seen = {name: _threads_cores(p.pid) for name, p in c.procs.items()}
    assert tuple(sorted(os.sched_getaffinity(0))) == mine  # the parent's own cores are back
    if placement == "off":
        assert seen == {name: {mine} for name in seen}
    else:
        assert seen == {"router": {cpus[:1]}, "prefill0": {cpus[:1]}, "decode0": {cpus[1:]}}
