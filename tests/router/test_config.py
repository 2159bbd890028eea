"""RouterConfig is the one source of the router's flags: `pdserve router` and `pdserve serve`
parse them into it with its own defaults, offer the same ones, and serve hands them on."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import fields, replace

import pytest

from pdserve.common.node.cli import flag_of
from pdserve.common.tracing import TracingConfig
from pdserve.router.__main__ import build_parser as router_parser
from pdserve.router.__main__ import parse_args
from pdserve.router.cluster.routing import PlacementConfig
from pdserve.router.config import RouterConfig, RouterLimits
from pdserve.serve import SERVE_OMITS, cluster_from_args
from pdserve.serve import build_parser as serve_parser

ENV = ("PDSERVE_API_KEY", "PDSERVE_PREFILL_PLACEMENT")
OPTIONS = [f for f in fields(RouterConfig) if "group" in f.metadata]  # the flags


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's conftest sets a placement for every router it starts: not for these."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def other_value(name: str, default: object) -> str:
    """A valid value for the flag of field name, other than its default, as typed."""
    action = next(a for a in router_parser()._actions if a.dest == name)
    if action.choices:
        return next(str(c) for c in action.choices if c != default)
    kind = action.type
    return {int: "7", float: "2.5"}.get(kind, "x") if default is None else str(kind(1) + default)


def test_every_router_flag_defaults_to_its_field_and_sets_it() -> None:
    assert OPTIONS, "RouterConfig declares its flags on its fields"
    assert parse_args(["m"]) == RouterConfig("m")
    for f in OPTIONS:
        value = other_value(f.name, f.default)
        config = parse_args(["--model", "m", flag_of(f.name), value])
        assert str(getattr(config, f.name)) == value, f.name
        assert replace(config, **{f.name: f.default}) == RouterConfig("m"), f"{f.name} leaks"


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return set(re.findall(r"(?m)^\s+(--[a-z][\w-]*)", p.format_help()))


def test_serve_and_router_offer_the_same_router_flags_with_the_same_defaults() -> None:
    router, serve = _flags(router_parser()), _flags(serve_parser())
    tracing = {flag_of(f.name) for f in fields(TracingConfig)}  # shared with the nodes
    expected = {flag_of(f.name) for f in OPTIONS} | tracing | {"--model"}
    assert router == expected
    # serve's own --max-model-len (the engine's) stands in for the router's: only
    # --control-host is missing, and the comment by SERVE_OMITS says why.
    assert router - serve == {"--control-host"}
    assert {flag_of(name) for name in SERVE_OMITS} == {"--control-host", "--max-model-len"}
    served = cluster_from_args(serve_parser(), serve_parser().parse_args(["m"]))
    assert served.router_args == []  # every router flag at its default: none handed on


def test_serve_hands_every_router_flag_it_is_given_to_its_router(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["--model", "m", "--api-key", "k", "--max-model-len", "99"]
    for f in OPTIONS:
        if f.name not in SERVE_OMITS | {"api_key"}:
            argv += [flag_of(f.name), other_value(f.name, f.default)]
    p = serve_parser()
    cluster = cluster_from_args(p, p.parse_args(argv))
    assert "k" not in cluster.children()["router"]
    monkeypatch.setenv("PDSERVE_API_KEY", cluster.api_key)  # how LocalCluster gives it
    got = parse_args(cluster.children()["router"][1:])
    want = {f.name: other_value(f.name, f.default) for f in OPTIONS}
    want |= {"api_key": "k", "max_model_len": "99", "control_host": "127.0.0.1"}
    assert {name: str(getattr(got, name)) for name in want} == want


def test_the_environment_fills_what_no_flag_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PREFILL_PLACEMENT", "local")
    monkeypatch.setenv("PDSERVE_API_KEY", "secret")
    assert "secret" not in router_parser().format_help()
    config = parse_args(["m"])
    assert (config.prefill_placement, config.api_key) == ("local", "secret")
    config = parse_args(["m", "--prefill-placement", "remote", "--api-key", "given"])
    assert (config.prefill_placement, config.api_key) == ("remote", "given")
    monkeypatch.setenv("PDSERVE_API_KEY", "")  # set but empty: no key, not an empty one
    assert parse_args(["m"]).api_key is None


def test_the_config_composes_limits_placement_and_name() -> None:
    config = parse_args(["m", "--max-queued-tokens", "7", "--local-prefill-threshold", "3"])
    assert config.limits == RouterLimits(max_queued_tokens=7)
    assert config.placement == PlacementConfig("auto", 3)
    assert config.served_name == "m"
    assert parse_args(["m", "--served-model-name", "n"]).served_name == "n"


@pytest.mark.parametrize(
    "flags,why",
    [
        (["--heartbeat-timeout", "0"], "heartbeat_timeout"),
        (["--lease-interval", "-1"], "lease_interval"),
        (["--max-queued-tokens", "0"], "max_queued_tokens"),
        (["--local-prefill-threshold", "-1"], "threshold"),
        (["--port", "70000"], "port"),
        (["--max-model-len", "0"], "max_model_len"),
    ],
)
def test_a_bad_router_flag_is_refused_at_parse_time(
    flags: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["m", *flags])
    assert exc.value.code == 2
    assert why in capsys.readouterr().err


def test_a_bad_value_fails_the_config_itself() -> None:
    for bad in ({"policy": "nope"}, {"tool_call_parser": "nope"}, {"model": ""}):
        with pytest.raises(ValueError):
            RouterConfig(**{"model": "m", **bad})


def test_reading_the_router_flags_imports_no_web_framework() -> None:
    """`pdserve serve` reads the router's flags without loading FastAPI (its router child
    does): RouterConfig and RouterLimits live apart from the app."""
    code = (
        "import sys, pdserve.serve, pdserve.router.config\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'pydantic'))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_serve_hands_the_tracing_flags_to_the_router_and_every_node() -> None:
    """The router and each node export their own spans: `pdserve serve` gives each child the
    flags it was given, and each child's config holds them."""
    from pdserve.common.node.launch import parse_node_args

    url = "http://127.0.0.1:4318/v1/traces"
    p = serve_parser()
    argv = ["m", "--otlp-traces-endpoint", url, "--trace-sample-ratio", "0.1"]
    children = cluster_from_args(p, p.parse_args(argv)).children()
    assert set(children) == {"router", "prefill0", "decode0"}
    want = TracingConfig(url, 0.1)
    assert parse_args(children.pop("router")[1:]).tracing == want
    for name, args in children.items():
        assert parse_node_args("node", "", args[1:])[1].tracing == want, name
    assert parse_args(["m"]).tracing == TracingConfig()  # off unless given
