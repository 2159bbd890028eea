"""Command-line flags shared by every node (and by `pdserve serve`), turned into configs in one
place. Flags come in named groups; every help line states its default and unit.

A config dataclass declares its flags on its fields (`config.option`): `add_options` adds them to
a parser and `options_of` builds the config back from the parsed flags, so a field's name,
default and help text live in one place (`NodeConfig`, the router's `RouterConfig`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, Field, fields
from typing import Any, TypeVar

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig

# KV_CONNECTORS: for the demo, which offers the nodes' choice of connector too.
from pdserve.common.node.config import KV_CONNECTORS, NodeConfig  # noqa: F401


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


def add_options(p: argparse.ArgumentParser, cls: type, omit: frozenset[str] = frozenset()) -> None:
    """Add the flags of cls's `option` fields, but those named in omit, in their groups."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in _options(cls):
        if f.name in omit:
            continue
        flag = dict(f.metadata)
        title, text, env = flag.pop("group"), flag.pop("help"), flag.pop("env", None)
        names = (flag.pop("flag", flag_of(f.name)), *flag.pop("aliases", ()))
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        kind = flag.pop("type", type(f.default))
        # None: not given (so the variable may apply), or a required flag's "none yet".
        default = None if env or f.default is MISSING else f.default
        group = groups[title]
        group.add_argument(*names, dest=f.name, default=default, type=kind, help=text, **flag)


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


def default_of(cls: type, name: str) -> Any:
    """The default of cls's field name: for a flag that spells a config field again (a
    supervisor's, handed on to its children)."""
    return next(f.default for f in fields(cls) if f.name == name)


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
    model = p.add_argument_group("model")
    model.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights, activations and KV cache (auto: bfloat16 on CUDA and on a CPU with "
        "AVX512-BF16 or AMX, else float32; float16 for an fp16 checkpoint on CUDA)",
    )
    model.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="decoder linear weights kept as int8/int4 (CPU; auto: as a GGUF stores them, none "
        "for safetensors; int8/int4 quantize at load)",
    )
    model.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    model.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size N, each rank holds 1/N of the experts whole instead "
        "of a 1/N slice of every expert (mixture-of-experts models)",
    )
    model.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    model.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every step eagerly; --no-enforce-eager compiles decode steps on CPU too "
        "(default: decode steps compiled on CUDA, eager on CPU, where compiling each batch "
        "bucket of a 30-layer model takes about a minute at start)",
    )
    cache = p.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    cache.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-bytes)"
    )
    cache.add_argument(
        "--kv-cache-bytes", type=int, default=256 * 1024**2, help="KV pool size on CPU (bytes)"
    )
    cache.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    sched = p.add_argument_group("scheduler")
    sched.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="tokens per engine step"
    )
    sched.add_argument("--max-num-seqs", type=int, default=64, help="requests per engine step")
    sched.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens per request (default: the model's own limit)",
    )
    sched.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="prompt tokens one request may take per step (tokens; 0: no cap)",
    )


def add_node_args(p: argparse.ArgumentParser) -> None:
    """Every node's flags: MODEL, the engine's, and NodeConfig's."""
    add_model_arg(p)
    add_engine_args(p)
    add_options(p, NodeConfig)


def engine_configs(args: argparse.Namespace) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    return (
        ModelConfig(
            args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            device=args.device,
            seed=args.seed,
            enforce_eager=args.enforce_eager,
            enable_expert_parallel=args.enable_expert_parallel,
        ),
        CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_bytes=args.kv_cache_bytes,
        ),
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        ),
    )


def node_config(args: argparse.Namespace) -> NodeConfig:
    """The node settings of parsed `add_node_args` flags (ValueError on a bad value)."""
    return options_of(NodeConfig, args)
