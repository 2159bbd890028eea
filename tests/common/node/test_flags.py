"""Every engine and node option is declared once, on its config dataclass (`option`): the
parsers take name, default and help from there, and no parser module spells one again; the
offline `LLM(...)` takes the engine configs' fields with their defaults, none written again."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from pdserve.common.engine.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pdserve.common.engine.llm import LLM, LLM_CONFIGS, llm_configs
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
    "kv_offload_bytes": 8192,
    "kv_store": "file:///tmp/kv",
    "kv_load_policy": "always",
    "max_num_batched_tokens": 100,
    "max_num_seqs": 3,
    "max_model_len": 50,
    "long_prefill_token_threshold": 5,
    "compile_cache_dir": "/tmp/c",
    "compile_mode": "blocking",
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
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


# A value other than the default for each field `LLM(...)` takes beyond the engine flags.
LLM_VALUES = {
    **ENGINE_VALUES,
    "load_format": "dummy",
    "gpu_memory_utilization": 0.5,
    "enable_chunked_prefill": False,
    "policy": "priority",
    "tensor_parallel_size": 2,
    "threads_per_rank": 1,
    "timeout_s": 5.0,
    "start_timeout_s": 9.0,
    "rank_agent": "m:A",
    "rank_agent_options": {"a": 1},
    "workers": "external",
    "host": "127.0.0.2",
    "port": 5,
    "otlp_traces_endpoint": "http://127.0.0.1:4318",
    "trace_service": "prefill",
}


def _names(config: type | object) -> set[str]:
    return {f.name for f in dataclasses.fields(config)}


def test_llm_takes_each_option_with_the_config_default() -> None:
    names = [_names(cls) - {"model_dir"} for cls in LLM_CONFIGS]
    assert sum(map(len, names)) == len(set().union(*names)) == len(LLM_VALUES)  # no overlap
    signature = inspect.signature(LLM).parameters
    for cls in LLM_CONFIGS:
        for f in dataclasses.fields(cls):
            if f.name != "model_dir":
                assert signature[f.name].default == f.default, f"LLM({f.name}=...)"
    for name, value in LLM_VALUES.items():
        given = {name: value, **({"port": 5} if name == "workers" else {})}  # external: a port
        expected = [ModelConfig("m", dtype="float32"), CacheConfig(), SchedulerConfig()]
        expected = [
            dataclasses.replace(c, **{k: v for k, v in given.items() if k in _names(c)})
            for c in (*expected, ParallelConfig())
        ]
        assert llm_configs("m", {"dtype": "float32", **given}) == tuple(expected), name


def test_llm_refuses_an_unknown_option_by_name() -> None:
    with pytest.raises(TypeError, match=r"unknown options \['blocksize', 'model_dir'\]"):
        llm_configs("m", {"blocksize": 8, "model_dir": "x"})


def test_llm_module_writes_no_option_again() -> None:
    """llm.py names no config field as a parameter, a keyword or a string (where a default
    would be written again): its signature comes from the configs."""
    tree = ast.parse((REPO / "common/engine/llm.py").read_text())
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg | ast.keyword):
            named.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named.add(node.value)
    fields = set().union(*map(_names, LLM_CONFIGS))
    assert named & fields <= {"model_dir"}  # the one required field: LLM's model
