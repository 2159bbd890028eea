"""Command-line flags shared by every node (and by `pdserve serve`), turned into configs in one
place. Flags come in named groups; every help line states its default and unit.

A config dataclass declares its flags on its fields (`common.options.option`): `add_options`
adds them to a parser and `options_of` builds the config back from the parsed flags, so a
field's name, default and help text live in one place (the engine's three configs,
`NodeConfig`, the router's `RouterConfig`, the supervisor's `Backoff`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, Field, fields
from typing import Any, TypeVar

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig

# KV_CONNECTORS: for the demo, which offers the nodes' choice of connector too.
from pdserve.common.node.config import KV_CONNECTORS, NodeConfig  # noqa: F401
from pdserve.common.tracing import TracingConfig

ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every help line ends with its default (unless it names one itself or has none);
    descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)".strip()
        return text


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter
    )


Config = TypeVar("Config")


def _options(cls: type) -> list[Field]:
    return [f for f in fields(cls) if "group" in f.metadata]


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_options(
    p: argparse.ArgumentParser,
    cls: type,
    omit: frozenset[str] = frozenset(),
    only: frozenset[str] | None = None,
) -> None:
    """Add the flags of cls's `option` fields (those in only, if given; but those in omit),
    each in its help group (one the parser already has by that title, else a new one)."""
    groups = {g.title: g for g in p._action_groups}
    for f in _options(cls):
        if f.name in omit or (only is not None and f.name not in only):
            continue
        title = f.metadata["group"]
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        _add_option(groups[title], f)


def _add_option(group: argparse._ArgumentGroup, f: Field) -> None:
    flag = dict(f.metadata)
    text, env = flag.pop("help"), flag.pop("env", None)
    del flag["group"]
    names = (flag.pop("flag", flag_of(f.name)), *flag.pop("aliases", ()))
    if "action" not in flag:  # an action's own type, if any, is given with it
        flag.setdefault("type", type(f.default))
    if "flag" in f.metadata and not {"action", "choices", "metavar"} & set(flag):
        flag["metavar"] = names[0].lstrip("-").replace("-", "_").upper()  # not the field's
    # None: not given (so the variable may apply), or a required flag's "none yet".
    default = None if env or f.default is MISSING else f.default
    group.add_argument(*names, dest=f.name, default=default, help=text, **flag)


def options_of(cls: type[Config], args: argparse.Namespace, **given: Any) -> Config:
    """cls from parsed `add_options` flags and the fields in given (ValueError on a bad
    value). A flag the parser lacks (omitted) leaves its field at the default; one the parser
    has under the same name from elsewhere (an engine flag) is taken."""
    values = {}
    for f in _options(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is None and "env" in f.metadata:
            value = os.environ.get(f.metadata["env"]) or f.default
        values[f.name] = value
    return cls(**values, **given)


def option_flags(config: Any, omit: frozenset[str] = frozenset()) -> list[str]:
    """The flags that give a command the `option` fields of config not at their defaults
    (those in omit aside): how a supervisor spells a config again for its child."""
    out = []
    for f in _options(type(config)):
        value = getattr(config, f.name)
        if f.name not in omit and value != f.default:
            out += [f.metadata.get("flag", flag_of(f.name)), str(value)]
    return out


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """MODEL as a positional (like `vllm serve MODEL`) or as --model (the launch scripts)."""
    p.add_argument(
        "model_pos",
        nargs="?",
        metavar="MODEL",
        help="HF checkpoint directory, or a .gguf file (or a directory holding one)",
    )
    p.add_argument("--model", default=None, help="the same as MODEL")


def resolve_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """args.model from whichever form was given; an error when neither or both disagree."""
    if args.model_pos and args.model and args.model_pos != args.model:
        p.error(f"MODEL {args.model_pos!r} and --model {args.model!r} disagree")
    args.model = args.model or args.model_pos
    if not args.model:
        p.error("a MODEL is required (positional or --model)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags: the `option` fields of ModelConfig, CacheConfig, SchedulerConfig."""
    for cls in ENGINE_CONFIGS:
        add_options(p, cls)


def add_node_args(p: argparse.ArgumentParser) -> None:
    """Every node's flags: MODEL, the engine's, and NodeConfig's."""
    add_model_arg(p)
    add_engine_args(p)
    add_options(p, NodeConfig)
    add_options(p, TracingConfig)


def engine_configs(args: argparse.Namespace) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    """The engine configs of parsed `add_engine_args` flags and args.model."""
    return (
        options_of(ModelConfig, args, model_dir=args.model),
        options_of(CacheConfig, args),
        options_of(SchedulerConfig, args),
    )


def node_config(args: argparse.Namespace) -> NodeConfig:
    """The node settings of parsed `add_node_args` flags (ValueError on a bad value)."""
    return options_of(NodeConfig, args, tracing=options_of(TracingConfig, args))
