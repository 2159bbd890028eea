"""Every engine and node option is declared once, on its config dataclass (`option`): the
parsers take name, default and help from there, and no parser module spells one again."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.node.cli import (
    ENGINE_CONFIGS,
    add_engine_args,
    add_node_args,
    engine_configs,
    node_config,
    parser,
)
from pdserve.common.node.config import NodeConfig
from pdserve.router.config import RouterConfig

REPO = Path(__file__).resolve().parents[3]
DECLARED = (*ENGINE_CONFIGS, NodeConfig, RouterConfig)
# The modules that build parsers: none may add a declared option's flag by hand.
PARSER_MODULES = (
    "common/node/cli.py",
    "common/node/launch.py",
    "pdserve/serve.py",
    "pdserve/cli.py",
    "router/__main__.py",
    "router/config.py",
    "prefill_node/__main__.py",
    "decode_node/__main__.py",
)
# A value other than the default for each engine flag (a flag without a value sets its own).
ENGINE_VALUES = {
    "dtype": "float16",
    "device": "cuda:1",
    "seed": 7,
    "enforce_eager": True,
    "quantization": "none",
    "enable_expert_parallel": True,
    "block_size": 32,
    "num_blocks": 9,
    "enable_prefix_caching": False,
    "kv_cache_bytes": 4096,
    "max_num_batched_tokens": 100,
    "max_num_seqs": 3,
    "max_model_len": 50,
    "long_prefill_token_threshold": 5,
    "compile_cache_dir": "/tmp/c",
}


def options(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "group" in f.metadata]


def node_parser() -> argparse.ArgumentParser:
    p = parser("test", "")
    add_node_args(p)
    return p


def test_parser_defaults_are_the_dataclass_defaults() -> None:
    args = node_parser().parse_args(["--model", "m", "--router", "h:1"])
    for cls in (*ENGINE_CONFIGS, NodeConfig):
        for f in options(cls):
            if f.default is not dataclasses.MISSING:
                assert getattr(args, f.name) == f.default, f"{cls.__name__}.{f.name}"
    model, cache, scheduler = engine_configs(args)
    assert (model, cache, scheduler) == (ModelConfig("m"), CacheConfig(), SchedulerConfig())
    assert node_config(args) == NodeConfig(("h:1",))


def _flags(p: argparse.ArgumentParser, name: str, value: object) -> list[str]:
    action = next(a for a in p._actions if a.dest == name)
    if action.nargs == 0:  # a switch: its first spelling sets the value under test
        return action.option_strings[:1]
    return [action.option_strings[0], str(value)]


def test_every_engine_flag_sets_its_own_field_and_no_other() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    flagged = {f.name for cls in ENGINE_CONFIGS for f in options(cls)}
    assert flagged == set(ENGINE_VALUES)  # a new flag needs a value above
    base = ["--dtype", "float32"]  # `auto` would resolve by the device under test
    for name in flagged:
        value = ENGINE_VALUES[name]
        args = p.parse_args([*base, *_flags(p, name, value)])
        args.model = "m"
        built = engine_configs(args)
        expected = [ModelConfig("m", dtype="float32"), CacheConfig(), SchedulerConfig()]
        expected = [
            dataclasses.replace(c, **{name: value}) if name in c.__dataclass_fields__ else c
            for c in expected
        ]
        assert built == tuple(expected), name


def _declared_flags() -> set[str]:
    flags = set()
    for cls in DECLARED:
        for f in options(cls):
            flags.add(f.metadata.get("flag", "--" + f.name.replace("_", "-")))
            flags.update(f.metadata.get("aliases", ()))
    return flags


def _hand_written_flags(source: str) -> set[str]:
    """The option strings of every `add_argument(...)` call in source."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if call and node.func.attr == "add_argument":
            found.update(a.value for a in node.args if isinstance(a, ast.Constant))
    return found


def test_no_parser_module_declares_an_option_again() -> None:
    declared = _declared_flags()
    assert {"--dtype", "--no-prefix-caching", "--router", "-tp", "--policy"} <= declared
    for module in PARSER_MODULES:
        again = _hand_written_flags((REPO / module).read_text()) & declared
        assert not again, f"{module} adds {sorted(again)} by hand: declare them on the config"
