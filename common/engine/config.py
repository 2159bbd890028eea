"""Engine configuration: one frozen dataclass per concern, validated on construction."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.common.model.dtype import DTYPES, resolve_auto
from pdserve.common.options import option
from pdserve.common.spec.config import SpeculativeConfig

_DTYPES = ("auto", *DTYPES)
QUANTIZATIONS = ("auto", "none", "int8", "int4")
COMPILE_MODES = ("eager", "background", "blocking")
KV_LOAD_POLICIES = ("always", "cost")  # kv_store.cost.POLICIES (kv_store sits above this)
EAGER_ENV = "PDSERVE_ENFORCE_EAGER"  # decides what the flags leave open (`decode_compile`)
# The help groups of the engine's flags (`node.cli.add_engine_args`).
MODEL, CACHE, SCHEDULER = "model", "KV cache", "scheduler"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _flag_value(parse: Callable[[str], Any], text: str) -> str:
    """text, once `parse` accepts it: a flag's bad value is a usage error that says what is
    wrong (argparse shows an ArgumentTypeError's message, not a ValueError's). The text itself
    goes on to the config, so a supervisor hands it to its children as given."""
    try:
        parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Where the weights are and how to run them.

    enforce_eager, compile_mode: how decode steps run (`decode_compile`, one graph per batch
    bucket: AOTInductor packages on CPU, torch.compile's graphs captured as CUDA graphs on
    CUDA). compile_mode "eager" runs every step eagerly, "blocking" compiles every bucket at
    start, "background" serves eager at once while a child process compiles the buckets the
    compile cache lacks, each switching to its package once loaded (CPU only). enforce_eager
    True means eager, False blocking. Neither given: $PDSERVE_ENFORCE_EAGER if set (1 eager,
    0 blocking), else by device: blocking on CUDA, background on CPU, where a bucket of a
    30-layer model takes minutes to compile cold (a warm start loads it from the compile
    cache, compile_cache_dir, in milliseconds: docs/architecture.md).
    load_format: "auto" reads the checkpoint's weights; "dummy" (vLLM's name) makes random
    ones from config.json alone, on the device, seeded by `seed` (benchmarks of model shapes
    whose weights are not at hand).
    dtype: weights, activations and KV cache; "auto" (docs/quantization.md) is resolved here,
    once, into the concrete dtype the layout digest, the KV cache and the wire carry.
    quantization: how the decoder's linear weights are held (docs/quantization.md): "auto"
    keeps a GGUF's quantized types quantized on the CPU (float everywhere else), "none"
    dequantizes, "int8"/"int4" quantize every one of them at load (CPU only).
    enable_expert_parallel: under tensor parallelism, each rank holds num_experts / N whole
    experts instead of a 1/N slice of every expert (vLLM's name; docs/models.md).
    """

    model_dir: str  # MODEL or --model, the flags every role shares (`add_model_arg`)
    dtype: str = option(
        "auto",
        MODEL,
        "weights, activations and KV cache (auto: bfloat16 on CUDA and on a CPU with "
        "AVX512-BF16 or AMX, else float32; float16 for an fp16 checkpoint on CUDA)",
        choices=_DTYPES,
    )
    device: str = option("cpu", MODEL, "cpu or cuda[:N]")
    seed: int = option(0, MODEL, "seed of the sampling generator")
    enforce_eager: bool | None = option(
        None,
        MODEL,
        "run every step eagerly (--compile-mode eager); --no-enforce-eager compiles every "
        "decode bucket at start (--compile-mode blocking)",
        action=argparse.BooleanOptionalAction,
    )
    compile_mode: str | None = option(
        None,
        MODEL,
        "decode steps: eager; blocking (every batch bucket compiled at start); background "
        "(eager at once, a child process compiles the buckets the compile cache lacks, each "
        "switching once loaded; CPU only). Default: background on CPU, blocking on CUDA",
        choices=COMPILE_MODES,
        type=str,
    )
    load_format: str = "auto"  # no flag (the `LLM` API sets it)
    quantization: str = option(
        "auto",
        MODEL,
        "decoder linear weights kept as int8/int4 (CPU; auto: as a GGUF stores them, none "
        "for safetensors; int8/int4 quantize at load)",
        choices=QUANTIZATIONS,
    )
    enable_expert_parallel: bool = option(
        False,
        MODEL,
        "with --tensor-parallel-size N, each rank holds 1/N of the experts whole instead "
        "of a 1/N slice of every expert (mixture-of-experts models)",
        action="store_true",
    )
    compile_cache_dir: str | None = option(
        None,
        MODEL,
        "where compiled steps are kept between starts, a folder per model, torch and flags "
        "(default: $PDSERVE_COMPILE_CACHE_DIR, else ~/.cache/pdserve/compile)",
        type=str,
    )

    def __post_init__(self) -> None:
        _require(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _require(
            self.quantization in QUANTIZATIONS,
            f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        _require(
            self.device == "cpu" or self.quantization in ("auto", "none"),
            f"quantization {self.quantization} runs on the CPU only (the CUDA int4 packing is "
            "not written): use --quantization none on CUDA",
        )
        _require(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        _require(
            self.enforce_eager is None or isinstance(self.enforce_eager, bool),
            f"enforce_eager must be a bool or None, got {self.enforce_eager!r}",
        )
        _require(
            self.compile_mode is None or self.compile_mode in COMPILE_MODES,
            f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}",
        )
        _require(
            self.compile_mode != "background" or self.device == "cpu",
            "compile_mode background runs on the CPU only (CUDA graphs are captured at start)",
        )
        _require(
            self.load_format in ("auto", "dummy"),
            f"load_format must be 'auto' or 'dummy', got {self.load_format!r}",
        )
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", resolve_auto(self.model_dir, self.device))

    @property
    def compile_decode(self) -> bool:
        """Whether decode steps run through the compiled model (at once or once compiled)."""
        return self.decode_compile != "eager"

    @property
    def decode_compile(self) -> str:
        """How decode steps run: "eager", "blocking" or "background". enforce_eager True wins;
        then compile_mode; then enforce_eager False (blocking, as before compile_mode); then
        $PDSERVE_ENFORCE_EAGER when set (1: eager, 0: blocking; the tests run eager unless
        one asks), else the device's default: blocking on CUDA, background on CPU."""
        if self.enforce_eager:
            return "eager"
        if self.compile_mode is not None:
            return self.compile_mode
        if self.enforce_eager is False:
            return "blocking"
        env = os.environ.get(EAGER_ENV)
        if env is not None:
            return "blocking" if env == "0" else "eager"
        return "blocking" if self.device.startswith("cuda") else "background"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: block geometry and size.

    num_blocks None means "size the pool from kv_cache_bytes" (CPU) or from free device
    memory times gpu_memory_utilization (CUDA).
    """

    block_size: int = option(16, CACHE, "tokens per KV block")
    num_blocks: int | None = option(
        None, CACHE, "KV blocks (default: from --kv-cache-bytes)", type=int
    )
    enable_prefix_caching: bool = option(
        True,
        CACHE,
        "turn prefix caching off (default: on)",
        flag="--no-prefix-caching",
        action="store_false",
    )
    kv_cache_bytes: int = option(256 * 1024**2, CACHE, "KV pool size on CPU (bytes)")
    kv_offload_bytes: int = option(
        0, CACHE, "host KV tier under the pool: evicted blocks kept in memory (bytes; 0: none)"
    )
    kv_store: str | None = option(
        None,
        CACHE,
        "shared KV tier under the pool and host tier: file://DIR or redis://HOST:PORT "
        "(docs/kv_tiers.md)",
        type=str,
        metavar="URL",
    )
    kv_load_policy: str = option(
        "cost",
        CACHE,
        "a prefix hit in a KV tier: load it only when the node's measured costs say loading "
        "is faster than recomputing (cost), or always (docs/kv_tiers.md)",
        choices=KV_LOAD_POLICIES,
    )
    gpu_memory_utilization: float = 0.85  # no flag (the `LLM` API sets it)

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size must be 2^k <= 128")
        _require(self.num_blocks is None or self.num_blocks >= 2, "num_blocks must be >= 2")
        _require(self.kv_cache_bytes > 0, "kv_cache_bytes must be positive")
        _require(self.kv_offload_bytes >= 0, "kv_offload_bytes must be >= 0")
        _require(
            self.kv_store is None or self.kv_store.split("://")[0] in ("file", "redis"),
            f"kv_store {self.kv_store!r}: use file://DIR or redis://HOST:PORT",
        )
        _require(self.kv_load_policy in KV_LOAD_POLICIES, f"kv_load_policy in {KV_LOAD_POLICIES}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization in (0, 1]")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching limits of one engine step.

    long_prefill_token_threshold caps how many prompt tokens one request may take in one step
    (0: no cap beyond the budget); chunked prefill splits prompts that exceed the budget.
    """

    max_num_batched_tokens: int = option(512, SCHEDULER, "tokens per engine step")
    max_num_seqs: int = option(64, SCHEDULER, "requests per engine step")
    max_model_len: int | None = option(
        None,
        SCHEDULER,
        "prompt + output tokens per request (default: the model's own limit)",
        type=int,
    )
    long_prefill_token_threshold: int = option(
        0, SCHEDULER, "prompt tokens one request may take per step (tokens; 0: no cap)"
    )
    enable_chunked_prefill: bool = True  # no flag (the `LLM` API sets it)
    policy: str = "fcfs"  # no flag (the `LLM` API sets it)
    speculative_config: SpeculativeConfig | None = option(
        None,
        SCHEDULER,
        "speculative decoding, vLLM's JSON keys, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3}\' (methods: ngram, suffix, '
        "draft_model, mtp; docs/speculative.md)",
        type=lambda text: _flag_value(SpeculativeConfig.parse, text),
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        # The flag, LLM() and a supervisor's child give JSON text or a dict: parsed here, once.
        if not isinstance(self.speculative_config, SpeculativeConfig | None):
            spec = SpeculativeConfig.parse(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(
            self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"
        )
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold >= 0")
        _require(self.policy in ("fcfs", "priority"), "policy must be 'fcfs' or 'priority'")
        _require(
            self.enable_chunked_prefill
            or self.max_model_len is None
            or self.max_model_len <= self.max_num_batched_tokens,
            "without chunked prefill, max_num_batched_tokens must cover max_model_len",
        )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many processes hold one engine's model (tensor parallelism, vLLM's
    `tensor_parallel_size`), and how they wait for each other.

    threads_per_rank: torch's intra-op threads in each rank (None: the machine's threads shared
    evenly). timeout_s bounds every collective between ranks and a worker's wait for the next
    step (rank 0 sends a keep-alive while idle); start_timeout_s bounds the workers' start,
    arrival and model load. rank_agent ("module:Class") is what each worker builds beside its
    model runner, as Class(runner, group, **rank_agent_options), for rank 0 to `call` (a
    node's per-rank KV connector end); the options travel as JSON. otlp_traces_endpoint: where
    each worker sends the spans of its part of traced requests' steps, as the service
    `trace_service` (the node's own --otlp-traces-endpoint and role; None: no spans).
    """

    tensor_parallel_size: int = 1
    threads_per_rank: int | None = None
    timeout_s: float = 60.0
    start_timeout_s: float = 600.0
    rank_agent: str | None = None
    rank_agent_options: dict[str, Any] | None = None
    otlp_traces_endpoint: str | None = None
    trace_service: str = "node"
    # "local": rank 0 starts its workers on this host; "external": it serves the rendezvous on
    # host:port and waits for workers started elsewhere (`pdserve tp-worker`, other hosts).
    workers: str = "local"
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        _require(
            self.threads_per_rank is None or self.threads_per_rank >= 1,
            "threads_per_rank must be >= 1",
        )
        _require(self.timeout_s > 0 and self.start_timeout_s > 0, "timeouts must be positive")
        _require(self.workers in ("local", "external"), "workers must be 'local' or 'external'")
        _require(
            self.workers == "local" or self.port > 0,
            "external tensor-parallel workers need a fixed rendezvous port",
        )
