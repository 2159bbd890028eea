"""A persistent cache of compiled steps: a second start of the same model and flags compiles
nothing.

On the CPU the folder holds one AOTInductor package per decode bucket (decode_packages.py),
found by the key alone: a start loads them without importing the compiler. Compiling them, and
compiling on CUDA, goes through torch's own caches in the same folder.

Torch keeps two on-disk caches of a compile: AOTAutograd's (the traced forward, keyed on the
graph) in front of inductor's FX graph cache (the generated kernels, keyed on the graph, torch's
version and inductor's config), both on by default, in one directory (TORCHINDUCTOR_CACHE_DIR,
else /tmp/torchinductor_<user>, which a reboot clears). An engine's compiles run with that
directory pointed at `<compile cache dir>/<key>`, where the key digests everything that shapes
its graphs: torch, pdserve and the compiled code's version (the GEMV's C++ included), the
model's shapes, class, dtype and weight form (with the GEMV's path, AVX2 or VNNI), the KV
block size, the tensor-parallel shard, the CPU's instruction set and the thread count
(generated CPU loops fix it when compiled). Not the batch buckets: each bucket is a graph (a
package) of its own, so engines with different bucket lists share the buckets they have in
common. Torch's own keys already refuse a stale graph, but a CPU package has only ours; and each
deployment gets its own directory, so a changed model or torch starts from an empty one instead
of searching (and growing) a shared one, and the directory's key.json says what it holds.

With torch.compile (CUDA) a warm start still imports the compiler and Dynamo traces the model
again (its guards are not cached); the kernels are loaded, not compiled.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DEFAULT_DIR = "~/.cache/pdserve/compile"
DIR_ENV = "PDSERVE_COMPILE_CACHE_DIR"  # the directory when no flag names one


@dataclass(frozen=True, slots=True)
class CompileKey:
    """What the graphs of one engine depend on; `digest()` names its cache directory."""

    torch: str
    pdserve: str
    code: str  # a hash of the compiled step's source and the model package's
    model: str  # class, architecture (every shape), dtype and weight form
    flags: str  # KV block size, device, tensor-parallel shard (not the buckets: one graph each)
    isa: str  # the CPU instruction set the kernels are generated for
    threads: int  # the intra-op threads the CPU kernels' parallel loops are generated for

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class CacheCounts:
    """Graphs of one warm-up that inductor loaded from the cache (hits) and compiled (misses)."""

    hits: int
    misses: int


@dataclass(frozen=True, slots=True)
class CompileCache:
    """Where one engine's compiles read and write: `root/<key digest>`."""

    root: Path
    key: CompileKey

    @property
    def path(self) -> Path:
        return self.root / self.key.digest()

    def run(self, compile_all: Callable[[], None]) -> CacheCounts:
        """Run compile_all with torch's caches in this directory; what it hit and missed."""
        from torch._dynamo.utils import counters
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "key.json").write_text(json.dumps(asdict(self.key), indent=1) + "\n")
        before = _inductor_counts(counters)
        with temporary_cache_dir(str(self.path)), _caches_on():
            compile_all()
        after = _inductor_counts(counters)
        return CacheCounts(after[0] - before[0], after[1] - before[1])


def cache_root(configured: str | None) -> Path:
    """The compile cache directory: the flag's, else $PDSERVE_COMPILE_CACHE_DIR's, else
    ~/.cache/pdserve/compile."""
    return Path(configured or os.environ.get(DIR_ENV) or DEFAULT_DIR).expanduser()


def compile_key(
    model: torch.nn.Module,
    arch: object,
    dtype: torch.dtype,
    flags: dict[str, object],
    code: str,
) -> CompileKey:
    """The key of a model's compiled steps; flags: whatever engine setting shapes the graphs."""
    from pdserve.common.model.quant import gemv_paths, weight_format  # numpy: when compiling

    # The GEMV's path is a constant of the graph (QuantizedLinear.vnni), set by the dtype and
    # $PDSERVE_CPU_QUANT: a package made on one path must not serve the other.
    form = " ".join(filter(None, [weight_format(model) or "float", gemv_paths(model)]))
    return CompileKey(
        torch=torch.__version__,
        pdserve=_pdserve_version(),
        code=code,
        model=f"{type(model).__name__} {arch!r} {dtype} {form}",
        flags=json.dumps(flags, sort_keys=True, default=str),
        isa=torch.backends.cpu.get_cpu_capability(),
        threads=torch.get_num_threads(),
    )


def _pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "unknown"


def _inductor_counts(counters: dict) -> tuple[int, int]:
    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]


@contextlib.contextmanager
def _caches_on() -> Iterator[None]:
    """Both caches on whatever the environment says (TORCHINDUCTOR_FX_GRAPH_CACHE=0 in a
    debugging shell would make every start compile everything again)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with (
        inductor_config.patch(fx_graph_cache=True),
        functorch_config.patch(enable_autograd_cache=True),
    ):
        yield
