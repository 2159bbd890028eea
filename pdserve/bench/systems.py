"""The systems the HTTP benchmarks compare, each started, waited for (with a timeout) and
stopped on exit: pdserve nodes and a router, the peer servers of `peers`, routers over fake
nodes."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.peers import (
    PEERS,
    VLLM_START_TIMEOUT,
    VllmLaunch,
    engine_dtype,
    llamacpp_command,
)
from pdserve.local_cluster import LocalCluster, free_port
from pdserve.testbed import fake_nodes

HOST = "127.0.0.1"


def threads_env(threads: int) -> dict[str, str | None]:
    """Torch threads of every server started inside (0: torch's own choice)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {}


def http_ok(url: str, contains: str = "") -> bool:
    """One look: `url` answers 200 (and its body holds `contains`)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200 and contains in resp.read().decode(errors="replace")
    except OSError:
        return False


def wait_until(ready: Callable[[], bool], procs: Mapping[str, subprocess.Popen], timeout: float,
               what: str) -> None:  # fmt: skip
    """Poll `ready` until it holds; RuntimeError when one of procs exits first or timeout
    passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"{what}: exited during start: {dead}")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:g}s")


def stop_group(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after timeout."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@contextmanager
def process_group(
    cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """`cmd` in a process group of its own, output into `log`; `stop_group` on exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        yield proc
    finally:
        stop_group(proc)


@contextmanager
def peer_server(name: str, cmd: Sequence[str], log_dir: Path, env: Mapping[str, str],
                timeout: float) -> Iterator[str]:  # fmt: skip
    """`cmd --host HOST --port P` on a free port P, until /v1/models answers; yields its URL."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [*cmd, "--host", HOST, "--port", str(port)]
    with process_group(cmd, log_dir / f"{name}.log", env) as proc:
        wait_until(lambda: http_ok(f"{url}/v1/models"), {name: proc}, timeout, url)
        yield url


@contextmanager
def transformers_serve(model: Path, batch_tokens: int, log_dir: Path, threads: int = 1,
                       timeout: float = 600, dtype: str = "float32") -> Iterator[str]:  # fmt: skip
    """`transformers serve --continuous-batching` (offline, `dtype`) on a free port; yields its
    URL."""
    hub_cache = log_dir / "hf-hub-cache"  # empty: /v1/models lists nothing instead of a 500
    hub_cache.mkdir(parents=True, exist_ok=True)
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    env = {**os.environ, **offline, **{k: v for k, v in threads_env(threads).items() if v}}
    cmd = transformers_command(model, batch_tokens, dtype)
    with peer_server("transformers-serve", cmd, log_dir, env, timeout) as url:
        yield url


TRANSFORMERS = (sys.executable, "-m", "transformers.cli.transformers", "serve")


def transformers_command(model: Path, batch_tokens: int, dtype: str) -> list[str]:
    """`transformers serve` on `model`, without --host and --port (the peer server adds them)."""
    cmd = [*TRANSFORMERS, str(model), "--continuous-batching", "--device", "cpu"]
    return cmd + ["--dtype", dtype, "--cb-max-batch-tokens", str(batch_tokens)]


@dataclass
class RoutersOverFakes:
    """Routers (`python -m pdserve.router`) and one process of fake nodes registered with
    each; `procs` by name: router0, router1, ..., fakes."""

    ports: list[int]
    control_ports: list[int]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # the cores this process may use when the rig starts, before a benchmark pins anything
    cpus: list[int] = field(default_factory=lambda: sorted(os.sched_getaffinity(0)))

    @property
    def routers(self) -> list[subprocess.Popen]:
        return [self.procs[f"router{i}"] for i in range(len(self.ports))]


@contextmanager
def routers_over_fakes(model: Path, routers: int, fakes: dict[str, Any], log_dir: Path,
                       router_args: Sequence[str] = (), timeout: float = 90.0
) -> Iterator[RoutersOverFakes]:  # fmt: skip
    """`routers` routers serving `model`'s tokenizer as "router-bench", then the fake nodes
    (`pdserve.testbed.fake_nodes`, spec `fakes` and the routers' control addresses); yields
    once every router counts the fake nodes live."""
    rig = RoutersOverFakes([free_port() for _ in range(routers)],
                           [free_port() for _ in range(routers)])  # fmt: skip
    with ExitStack() as stack:
        for i, (port, control) in enumerate(zip(rig.ports, rig.control_ports)):
            cmd = [sys.executable, "-m", "pdserve.router", str(model), "--host", HOST]
            cmd += ["--served-model-name", "router-bench", "--port", str(port)]
            cmd += ["--control-port", str(control), *router_args]
            router = process_group(cmd, log_dir / f"router{i}.log")
            rig.procs[f"router{i}"] = stack.enter_context(router)
        spec = {**fakes, "routers": [f"{HOST}:{c}" for c in rig.control_ports]}
        fakes_log = log_dir / "fakes.log"
        rig.procs["fakes"] = stack.enter_context(process_group(fake_nodes.command(spec), fakes_log))
        want = f"pdserve_backend_nodes_colocated {float(fakes['nodes'])}"
        deadline = time.monotonic() + timeout
        for port in rig.ports:
            url = f"http://{HOST}:{port}/metrics"
            ready = functools.partial(http_ok, url, want)
            left = max(0.0, deadline - time.monotonic())
            wait_until(ready, rig.procs, left, f"router at {url} (logs in {log_dir})")
        yield rig


SMOLLM2_DIR = "smollm2-135m-instruct"  # under --cache-dir, one folder per dtype
SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
REMOTE = ("--prefill-placement", "remote")  # every prefill on a prefill node
DEFAULT_BATCH_TOKENS = 512  # pdserve's --max-num-batched-tokens (pdserve.common.node.cli)


@dataclass(frozen=True, slots=True)
class System:
    """One system compared: (prefill, decode, colocated) pdserve nodes with flags of its router
    and of its decode nodes, or (shape None) the server `peer` names (a key of PEERS)."""

    name: str
    shape: tuple[int, int, int] | None
    router_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    peer: str = ""

    @property
    def what(self) -> str:
        if self.shape is None:
            return PEERS[self.peer]
        if not self.shape[0]:
            return "one node, role both"
        decode = f", decode node `{' '.join(self.decode_args)}`" if self.decode_args else ""
        return f"1P1D, `{' '.join(self.router_args)}`{decode}"


@contextmanager
def start_system(spec: System, args: argparse.Namespace, model: Path | str) -> Iterator[tuple]:
    """Start one system with every server process at args.threads torch threads; yields its
    URL and the health URLs of its decode nodes (their KV gauges)."""
    log_dir = args.log_dir / spec.name
    if spec.shape is None:
        with start_peer(spec, args, Path(model), log_dir) as url:
            yield url, []
        return
    port, model = free_port(), getattr(args, "gguf", None) or model  # a GGUF: pdserve's own
    decode = ["--health-port", str(port), *spec.decode_args] if spec.shape[1] else []
    router = [*heartbeat_args(getattr(args, "heartbeat_timeout", 0.0)), *spec.router_args]
    flags = dict(engine_args=list(args.engine_args), router_args=router, decode_args=decode)
    cluster = LocalCluster(str(model), *spec.shape, kv_connector="zmq", log_dir=str(log_dir),
                           **flags)  # fmt: skip
    with environ(threads_env(args.threads)), cluster:  # (prefill, decode, colocated) nodes
        yield cluster.url, [f"http://127.0.0.1:{port}"] if spec.shape[1] else []


def start_peer(spec: System, args: argparse.Namespace, model: Path,
               log_dir: Path) -> contextlib.AbstractContextManager[str]:  # fmt: skip
    """The peer server `spec` names, on pdserve's token budget, dtype and threads."""
    tokens = batch_tokens(args.engine_args)
    if spec.peer == "llamacpp":
        cmd = llamacpp_command(args.gguf, tokens, args.threads)
        return peer_server(spec.name, cmd, log_dir, os.environ, 600.0)
    if spec.peer == "vllm":
        launch = VllmLaunch.of(args.vllm_python, model, args.engine_args, args.threads)
        threads = {k: v for k, v in threads_env(args.threads).items() if v}
        env = {**os.environ, **threads, **launch.env}
        return peer_server(spec.name, launch.command, log_dir, env, VLLM_START_TIMEOUT)
    dtype = engine_dtype(args.engine_args, model)
    return transformers_serve(model, tokens, log_dir, args.threads, dtype=dtype)


def peer_settings(spec: System, args: argparse.Namespace, model: Path) -> str:
    """How the peer `spec` names is started (as start_peer starts it), for the report's setup:
    its cores or threads, dtype, KV room and flags, so a reader sees the same cores and dtype
    as pdserve's were kept."""
    tokens, threads = batch_tokens(args.engine_args), args.threads or os.cpu_count()
    if spec.peer == "llamacpp":  # flags after `--model PATH`: threads, batch, context
        cmd = llamacpp_command(args.gguf, tokens, args.threads)
        flags = cmd[cmd.index("--model") + 2 :]
        return f"{args.gguf.name}, `{' '.join(flags)}`"
    if spec.peer == "vllm":
        return VllmLaunch.of(args.vllm_python, model, args.engine_args, args.threads).settings
    dtype = engine_dtype(args.engine_args, model)
    flags = transformers_command(model, tokens, dtype)[len(TRANSFORMERS) + 1 :]
    return f"`{' '.join(flags)}`, {threads} torch threads (`OMP_NUM_THREADS`)"


Measure = Callable[[System, str, list[str], dict[str, Any]], None]


def measure_systems(args: argparse.Namespace, systems: dict[str, System], model: Path | str,
                    measure: Measure, order: Sequence[str] | None = None
                    ) -> tuple[dict[str, dict[str, Any]], list[str]]:  # fmt: skip
    """Each system of args.systems (in `order`, if given) started, measured by measure(system,
    url, health URLs, its record) and stopped before the next starts. A system that cannot
    start or go on keeps what it measured, noted."""
    results: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for name in args.systems if order is None else order:
        results[name] = {}
        print(f"== {name}: starting", flush=True)
        started = time.monotonic()
        try:
            with start_system(systems[name], args, model) as (url, health):
                print(f"== {name}: ready at {url} in {time.monotonic() - started:.0f}s")
                measure(systems[name], url, health, results[name])
        except (RuntimeError, OSError, httpx.HTTPError) as exc:
            notes.append(f"{name} stopped: {exc}")
            print(f"!! {name}: {exc}", file=sys.stderr, flush=True)
    return results, notes


def smollm2_model(cache_dir: Path, dtype: str, gguf: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct (or `gguf`) as an HF directory of `dtype` safetensors (the dtype
    the run serves: vLLM and transformers serve load it in that dtype), made once per dtype
    from the GGUF pdserve serves, so every system loads the same weights. Built aside and
    renamed, so a concurrent run never reads half a model; another GGUF gets its own folder."""
    from pdserve.common.model.checkpoint import Checkpoint
    from pdserve.models import smollm2

    gguf = gguf or smollm2()
    out = cache_dir / f"{SMOLLM2_DIR}-{SHORT_DTYPES[dtype]}-{gguf.stat().st_size}"
    if (out / "model.safetensors").is_file():
        return out
    print(f"writing {gguf.name} as {dtype} safetensors into {out}", flush=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        built = shutil.copytree(Checkpoint.resolve(gguf).hf_dir(), Path(tmp) / "m")
        _write_safetensors(gguf, built, dtype)
        with contextlib.suppress(OSError):  # another run got there first
            os.rename(built, out)
    return out


def _write_safetensors(gguf: Path, into: Path, dtype: str) -> None:
    """The GGUF's weights as pdserve's loader reads them (dequantized to float32, q/k rows in
    HF order) then cast to `dtype` (one rounding, from float32), into model.safetensors; the
    dtype and the model class into config.json (transformers serve picks the class by
    `architectures`)."""
    import torch
    from safetensors.torch import save_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pdserve.common.model.weights import load_model

    model, _ = load_model(gguf, torch.float32, "cpu")
    cast = getattr(torch, dtype)
    state = {n: p.to(cast).contiguous() for n, p in model.named_parameters()}  # tied: embeddings
    save_file(state, into / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((into / "config.json").read_text())
    config.update(architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]])
    (into / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n")


def heartbeat_args(heartbeat_timeout: float) -> list[str]:
    """The router's `--heartbeat-timeout` (0: the router's own)."""
    return ["--heartbeat-timeout", f"{heartbeat_timeout:g}"] if heartbeat_timeout > 0 else []


def batch_tokens(engine_args: Sequence[str]) -> int:
    """pdserve's token budget per step: the passed --max-num-batched-tokens or its default."""
    return engine_flag(engine_args, "--max-num-batched-tokens", DEFAULT_BATCH_TOKENS)


def engine_flag(engine_args: Sequence[str], flag: str, default: Any) -> Any:
    """The value of `flag` among engine flags (`--flag V` or `--flag=V`) as default's type,
    else default."""
    args = list(engine_args)
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}=") or (arg == flag and i + 1 < len(args)):
            return type(default)(arg.split("=", 1)[1] if "=" in arg else args[i + 1])
    return default


@contextmanager
def environ(values: dict[str, str | None]) -> Iterator[None]:
    """os.environ with `values` set (None: unset) for children started inside, then restored."""
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in values.items() if v is not None})
    for k in [k for k, v in values.items() if v is None]:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM unwinds the with-blocks (which stop every child a benchmark started) instead
    of killing the process."""

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
