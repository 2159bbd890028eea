"""NodeConfig: validated settings, built from the node flags in one place."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.common.node.cli import add_node_args, flag_of, node_config, parser
from pdserve.common.node.colocated import ColocatedNode
from pdserve.common.node.config import KV_CONNECTORS, NodeConfig
from pdserve.common.node.launch import run_node
from pdserve.kv_transfer import connector_names


def test_flags_become_one_node_config() -> None:
    p = parser("test", "")
    add_node_args(p)
    args = p.parse_args(
        "m --router 10.0.0.1:8100 --node-id d0 --heartbeat-interval 0.25 --lease-timeout 3 "
        "--max-queued-requests 7 --drain-timeout 0 --stall-timeout 9 --curve-dir keys "
        "--kv-connector shm --host 0.0.0.0 --kv-port 9100 --router 10.0.0.2:8100 "
        "--advertise-host 10.0.0.7 --health-port 8200".split()
    )
    assert node_config(args) == NodeConfig(
        router_addrs=("10.0.0.1:8100", "10.0.0.2:8100"),
        node_id="d0",
        heartbeat_interval=0.25,
        lease_timeout=3.0,
        max_queued_requests=7,
        drain_timeout=0.0,
        stall_timeout=9.0,
        curve_dir="keys",
        kv_connector="shm",
        host="0.0.0.0",
        advertise_host="10.0.0.7",
        kv_port=9100,
        health_port=8200,
    )


def test_every_node_flag_defaults_to_its_field_and_sets_it() -> None:
    """NodeConfig's fields are the node's flags: parsed with none given, each keeps the
    dataclass's default; given, each sets its own field and no other."""
    p = parser("test", "")
    add_node_args(p)
    base = NodeConfig(("h:1",))
    assert node_config(p.parse_args(["m", "--router", "h:1"])) == base
    values = {
        "node_id": "n",
        "heartbeat_interval": 0.25,
        "lease_timeout": 3.0,
        "max_queued_requests": 7,
        "drain_timeout": 0.0,
        "stall_timeout": 9.0,
        "curve_dir": "keys",
        "kv_connector": "shm",
        "host": "0.0.0.0",
        "advertise_host": "10.0.0.7",
        "kv_port": 9100,
        "health_port": 8200,
        "kv_fence_timeout": 2.0,
        "tensor_parallel_size": 2,
        "threads_per_rank": 1,
        "tp_workers": "external",
        "tp_port": 8400,
    }
    flagged = {f.name for f in dataclasses.fields(NodeConfig) if f.metadata}
    assert flagged == set(values) | {"router_addrs"}  # connect_timeout alone has no flag
    needs = {"tp_workers": {"tp_port": 8400}}  # external workers need a fixed port
    for name, value in values.items():
        more = needs.get(name, {})
        flags = [x for k, v in more.items() for x in (flag_of(k), str(v))]
        args = p.parse_args(["m", "--router", "h:1", flag_of(name), str(value), *flags])
        assert node_config(args) == dataclasses.replace(base, **{name: value, **more}), name


def test_tp_has_vllms_short_flag_and_refuses_nonsense() -> None:
    p = parser("test", "")
    add_node_args(p)
    assert node_config(p.parse_args(["m", "--router", "h:1", "-tp", "4"])).tensor_parallel_size == 4
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        NodeConfig(("h:1",), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="threads_per_rank must be >= 1, got 0"):
        NodeConfig(("h:1",), threads_per_rank=0)
    with pytest.raises(ValueError, match="--tp-workers external needs a fixed --tp-port"):
        NodeConfig(("h:1",), tp_workers="external")


def test_serve_spells_the_node_defaults_it_repeats_from_node_config() -> None:
    from pdserve.serve import build_parser

    args = build_parser().parse_args(["m"])
    assert (args.kv_connector, args.drain_timeout) == (
        NodeConfig(("h:1",)).kv_connector,
        NodeConfig(("h:1",)).drain_timeout,
    )


def test_defaults_are_valid_and_the_config_is_frozen() -> None:
    config = NodeConfig(("127.0.0.1:8100",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lease_timeout = 1.0  # type: ignore[misc]
    assert not hasattr(config, "__dict__")  # slotted


@pytest.mark.parametrize(
    "bad",
    [
        {"router_addrs": ()},
        {"router_addrs": ("localhost",)},
        {"router_addrs": (":8100",)},
        {"router_addrs": ("h:0",)},
        {"router_addrs": ("h:1", "h:70000")},
        {"router_addrs": ("h:1", "h:1")},
        {"advertise_host": "0.0.0.0"},
        {"advertise_host": ""},
        {"health_port": 70000},
        {"node_id": " "},
        {"heartbeat_interval": 0.0},
        {"lease_timeout": -1.0},
        {"stall_timeout": 0.0},
        {"connect_timeout": 0.0},
        {"drain_timeout": -0.5},
        {"max_queued_requests": 0},
        {"kv_connector": "rdma"},
        {"host": ""},
        {"kv_port": 65536},
        {"kv_port": -1},
    ],
)
def test_bad_values_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        NodeConfig(**{"router_addrs": ("127.0.0.1:8100",), **bad})


def test_a_bad_flag_value_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_node(ColocatedNode, "t", "", ["m", "--router", "h:1", "--lease-timeout", "0"])
    assert exit_.value.code == 2
    assert "lease_timeout must be > 0" in capsys.readouterr().err


def test_the_cli_offers_exactly_the_registered_connectors() -> None:
    assert sorted(KV_CONNECTORS) == sorted(connector_names())
