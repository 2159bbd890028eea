"""The router's settings: `RouterConfig` is the one place its flags are named, defaulted and
explained; `python -m pdserve.router` and `pdserve serve` both add them with `add_router_args`
and read them back with `router_config`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.common.node.cli import add_options, options_of
from pdserve.common.options import option
from pdserve.common.tracing import TracingConfig
from pdserve.router.cluster.registry import TierCredit
from pdserve.router.cluster.routing import PLACEMENTS, POLICIES, PlacementConfig
from pdserve.router.tools import PARSERS

API, CLUSTER, LIMITS, SECURITY = "HTTP API", "cluster", "limits and admission", "security"


@dataclass(frozen=True, slots=True)
class RouterLimits:
    """Bounds that keep the router's memory and the cluster's queues finite (`Admission`
    enforces them; here, not there, so that reading flags imports no web framework).

    max_request_bytes bounds one request body. max_queued_requests bounds the backend
    requests (choices) admitted and not yet finished, and max_queued_tokens their prompt
    tokens; the router does not know how many of them the nodes run at once, so the bounds
    count running and waiting ones alike. Beyond either bound a request gets 503 with
    Retry-After at once, without reaching the backend. A request larger than the token
    bound alone is still admitted when nothing else is in flight, so every valid request can
    eventually be served.
    """

    max_request_bytes: int = 16 * 1024**2
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1024**2

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_queued_requests", "max_queued_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


_LIMITS = RouterLimits()  # the admission bounds' defaults are RouterLimits' own
_CREDIT = TierCredit()  # and the KV tier credits' TierCredit's


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Every setting of one router process. Each field but model and the timeouts at the end
    is the flag of its name (--served-model-name for served_model_name); its default and help
    text are here only. `ClusterBackend` takes the whole config."""

    model: str  # MODEL or --model, the flags every role shares (`add_model_arg`)
    served_model_name: str | None = option(
        None, API, "the model's name in the API (default: MODEL as given)", type=str
    )
    host: str = option(
        "127.0.0.1", API, "address to bind HTTP (and, without --control-host, control) on"
    )
    port: int = option(8000, API, "HTTP port")
    api_key: str | None = option(
        None,
        API,
        "Bearer key every route but /health requires (default: env PDSERVE_API_KEY, else none)",
        env="PDSERVE_API_KEY",  # from the environment: `ps` never shows it, --help never prints it
        type=str,
    )
    max_model_len: int | None = option(
        None, API, "prompt + output tokens per request (default: the model's own limit)", type=int
    )
    tool_call_parser: str = option(
        "hermes",
        API,
        "how replies are read as tool calls: hermes (<tool_call> blocks: Qwen2.5, Qwen3, "
        "SmolLM2 with the default tool prompt) or llama3_json (Llama 3.1+)",
        choices=PARSERS,
    )
    control_host: str | None = option(None, CLUSTER, "default: --host", type=str)
    control_port: int = option(8100, CLUSTER, "port nodes register on")
    policy: str = option("least_loaded", CLUSTER, "how nodes are picked", choices=sorted(POLICIES))
    prefill_placement: str = option(
        PlacementConfig().mode,
        CLUSTER,
        "where prompts are prefilled when decode nodes exist: auto (per request, by a cost "
        "model from the nodes' measured rates, or by --local-prefill-threshold), remote (always "
        "on a prefill node) or local (always on the decode node). Default: auto, or "
        "$PDSERVE_PREFILL_PLACEMENT",
        env="PDSERVE_PREFILL_PLACEMENT",
        choices=PLACEMENTS,
    )
    local_prefill_threshold: int | None = option(
        None,
        CLUSTER,
        "with auto placement: prefill on the decode node when it lacks at most this many "
        "prompt tokens, else remotely (replaces the cost model)",
        type=int,
        metavar="TOKENS",
    )
    kv_host_load_cost: float = option(
        _CREDIT.host_cost,
        CLUSTER,
        "what loading a prompt block from a node's host KV tier costs, as a fraction of "
        "computing it (one in its device pool: 0; 1 or more: worth nothing): prefix-aware "
        "placement and the local/remote prefill choice credit cached blocks by it",
    )
    kv_shared_load_cost: float = option(
        _CREDIT.shared_cost,
        CLUSTER,
        "the same for a block some node of the node's shared KV store (--kv-store) wrote there",
    )
    heartbeat_timeout: float = option(
        5.0, CLUSTER, "a node silent this long (s) leaves the rotation; its requests fail over"
    )
    lease_interval: float = option(
        1.0, CLUSTER, "how often (s) the router renews the leases of the requests nodes hold"
    )
    max_request_bytes: int = option(
        _LIMITS.max_request_bytes, LIMITS, "larger request bodies get 413 (bytes)"
    )
    max_queued_requests: int = option(
        _LIMITS.max_queued_requests,
        LIMITS,
        "backend requests (choices) in flight beyond which new requests get 503",
    )
    max_queued_tokens: int = option(
        _LIMITS.max_queued_tokens,
        LIMITS,
        "prompt tokens in flight beyond which new requests get 503",
    )
    request_log: str | None = option(
        None,
        API,
        "append one JSON line per finished request to FILE (lengths, prompt block hashes, "
        "stage times, nodes, outcome; no text) for `pdserve bench replay`",
        type=str,
        metavar="FILE",
    )
    curve_dir: str | None = option(
        None,
        SECURITY,
        "CurveZMQ keys (`pdserve keygen DIR`): only nodes holding them join (default: no "
        "encryption)",
        type=str,
    )
    # No flags (tests shorten them): how long the router waits for a node's reply to a control
    # request, for a stream's next token before it fails the request, for a decode node with
    # room, and for a decode node's KV endpoint to answer at registration (s); how often one
    # request may fail over before it fails.
    reply_timeout: float = 10.0
    token_timeout: float = 120.0
    reserve_wait: float = 10.0
    probe_timeout: float = 3.0
    max_failovers: int = 3
    # Its flags are TracingConfig's own, shared with the nodes (`add_router_args` adds them).
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a router needs a MODEL")
        self.limits, self.placement, self.tier_credit  # noqa: B018 (each validates its own)
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}")
        if self.tool_call_parser not in PARSERS:
            why = f"tool call parser must be one of {PARSERS}, got {self.tool_call_parser!r}"
            raise ValueError(why)
        for name in ("port", "control_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")
        for name in ("heartbeat_timeout", "lease_interval", "reply_timeout", "token_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 token, got {self.max_model_len}")
        if min(self.reserve_wait, self.probe_timeout, self.max_failovers) < 0:
            raise ValueError("reserve_wait, probe_timeout and max_failovers must be >= 0")

    @property
    def limits(self) -> RouterLimits:
        bounds = (self.max_request_bytes, self.max_queued_requests, self.max_queued_tokens)
        return RouterLimits(*bounds)

    @property
    def tier_credit(self) -> TierCredit:
        return TierCredit(self.kv_host_load_cost, self.kv_shared_load_cost)

    @property
    def placement(self) -> PlacementConfig:
        return PlacementConfig(self.prefill_placement, self.local_prefill_threshold)

    @property
    def control_address(self) -> str:
        """Where nodes register: --control-host (default --host) and --control-port."""
        return f"tcp://{self.control_host or self.host}:{self.control_port}"

    @property
    def served_name(self) -> str:
        """The model's name in the API: vLLM's rule, MODEL as the user typed it by default."""
        return self.served_model_name or self.model


def add_router_args(p: argparse.ArgumentParser, omit: frozenset[str] = frozenset()) -> None:
    """The router's flags (but the fields in omit); MODEL is `add_model_arg`'s."""
    add_options(p, RouterConfig, omit)
    add_options(p, TracingConfig, omit)


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig of parsed `add_router_args` flags (ValueError on a bad value)."""
    tracing = options_of(TracingConfig, args)
    return options_of(RouterConfig, args, model=args.model, tracing=tracing)
