"""Decode steps through torch.compile (inductor): one graph per batch-size bucket.

A decode step (every sequence brings one new token) is the step a server runs most, and in
eager mode it pays Python and dispatch costs for each of a few hundred small operations. Here
the whole step up to the logits (embedding, every layer's norms, projections, rope and MLP,
the final norm, the LM head) is one inductor graph. The paged attention with its KV store
stays out of it as one opaque custom op per layer (`pdserve::paged_attention`), and the
graph marks the sizes of the attention metadata unknown: block tables and sequence lengths
change every step and never make it recompile. The batch is padded up to its bucket (1, 2,
4, ... up to max_num_seqs), so each bucket compiles once; padded rows store no K/V and their
logits are dropped. Prefill and mixed steps, and steps with a per-layer hook, run eager.

On the CPU each bucket is an AOTInductor package kept in the compile cache (made by
`background_compile.py`), which a later start loads with torch's C++ loader (`DecodePackage`)
without importing the compiler or tracing again: torch.compile's on-disk caches would still
import Dynamo and inductor (about 3.5 CPU seconds here, more than a whole eager start of the
tiny model) and trace each bucket again. A package holds no weights: they are handed to it at
load, by name, as the model's own tensors (no copy). By default (`start_background`) the
buckets the cache lacks are compiled by a child process while the engine serves them eager;
each switches to its package between two steps, once loaded (`ReadyBuckets` hands them over,
so the step never runs the compile's code).

On CUDA each bucket's compiled step is then captured as a CUDA graph over static inputs
(`cuda_graphs.DecodeGraphs`), so a decode step is a few copies and one graph launch instead of
a few hundred kernel launches from Python.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve import kernels
from pdserve.common.engine import background_compile, cuda_graphs
from pdserve.common.engine.background_compile import BackgroundCompile, CompileJob, package_file
from pdserve.common.engine.compile_cache import CacheCounts, CompileCache
from pdserve.common.engine.config import ModelConfig
from pdserve.common.model import attention
from pdserve.common.model.attention import AttentionMetadata
from pdserve.common.model.llama import LlamaFamilyForCausalLM

log = logging.getLogger(__name__)

MAX_GRAPHS = 64  # decode graphs one process may hold (buckets x engines)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: the powers of two below max_num_seqs, and max_num_seqs."""
    assert max_num_seqs >= 1, "max_num_seqs must be >= 1"
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return (*sizes, max_num_seqs)


class CompiledDecode:
    """The model's pure decode steps, compiled once per batch bucket.

    `logits` takes a decode step's inputs (B sequences, one token each, B <= the largest
    bucket) and returns float32 logits of its first B rows. `num_compiles` counts the graphs
    made ready, compiled or loaded from the cache: one per bucket, unless something forces a
    recompile. On the CPU the buckets are AOTInductor packages (`packages`), on CUDA
    torch.compile's graphs (replayed as CUDA graphs).
    """

    def __init__(
        self,
        model: LlamaFamilyForCausalLM,
        max_num_seqs: int,
        max_blocks_per_seq: int | None = None,
        buckets: tuple[int, ...] | None = None,
    ) -> None:
        self.model = model
        self.buckets = decode_buckets(max_num_seqs) if buckets is None else tuple(sorted(buckets))
        self.num_compiles = 0
        self.compile_seconds: float | None = None  # of the warm-up, once done
        self.cache_counts: CacheCounts | None = None  # of the warm-up, when it had a cache
        self.max_blocks_per_seq = max_blocks_per_seq  # the graphs' block-table width
        self.graphs: cuda_graphs.DecodeGraphs | None = None  # captured by warm_up on CUDA
        self.packages: dict[int, DecodePackage] = {}  # loaded by warm_up on CPU
        self.cache: CompileCache | None = None  # where warm_up found or put the compiled steps
        self.background: BackgroundCompile | None = None  # compiling what the cache lacked
        self.ready = ReadyBuckets()  # its packages, until a step adopts them

    @functools.cached_property
    def _step(self) -> Callable[..., torch.Tensor]:
        # Made on first use: torch.compile imports Dynamo (seconds), which a CPU start skips.
        return torch.compile(self._forward, backend=self._backend, dynamic=False, fullgraph=True)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, attn, kv_caches))

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        self.num_compiles += 1
        return compile_fx(
            gm, example_inputs, config_patches={"post_grad_custom_post_pass": _code_version()}
        )

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds `batch` sequences; None when none does."""
        return next((b for b in self.buckets if b >= batch), None)

    def runs(self, batch: int) -> bool:
        """Whether a decode step of `batch` sequences runs compiled now. While a background
        compile runs, the packages it loaded since the last step are adopted here, between two
        steps (a step runs wholly in one mode), and a bucket without one runs eager."""
        size = self.bucket(batch)
        if size is None or self.background is None:
            return size is not None
        self.ready.note(size)
        ready = self.ready.take()
        self.packages.update(ready)
        self.num_compiles += len(ready)
        return size in self.packages

    def close(self) -> None:
        """Stop a background compile (its child is killed; its buckets stay eager)."""
        if self.background is not None:
            self.background.close()

    def logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Logits [B, vocab] of a decode step of B = len(input_ids) sequences."""
        batch = input_ids.shape[0]
        size = self.bucket(batch)
        assert size is not None, f"{batch} rows exceed the largest bucket {self.buckets[-1]}"
        if self.graphs is not None and self.graphs.fits(attn):
            return self.graphs.replay(input_ids, positions, attn, size)
        if size > batch:
            # Padded rows: token 0 at position 0; the attention op neither stores nor reads
            # for rows past the slot mapping, so they never reach the real rows.
            input_ids = torch.nn.functional.pad(input_ids, (0, size - batch))
            positions = torch.nn.functional.pad(positions, (0, size - batch))
        if size in self.packages:
            return self.packages[size](input_ids, positions, attn, kv_caches)[:batch]
        cuda_graphs.mark_unbacked(attn)
        return self._step(input_ids, positions, attn, kv_caches)[:batch]

    def warm_up(self, kv_caches: list[torch.Tensor], cache: CompileCache | None = None) -> float:
        """Compile every bucket now (through `cache`'s directory, if given; on the CPU it must
        be), on CUDA with a dummy step each that writes only slot 0 of the null block; the
        seconds it took, also logged."""
        start = time.perf_counter()
        self.cache = cache
        if kv_caches[0].device.type == "cpu":
            assert cache is not None, "CPU packages live in a compile cache"
            self.packages, self.cache_counts = load_packages(
                self.model, self.buckets, kv_caches, cache
            )
            self.num_compiles += len(self.packages)
        elif cache is None:
            self._compile_buckets(kv_caches)
        else:
            self.cache_counts = cache.run(lambda: self._compile_buckets(kv_caches))
        self.compile_seconds = time.perf_counter() - start
        log.info(
            "compiled decode buckets %s in %.1f s%s%s",
            list(self.buckets),
            self.compile_seconds,
            " (CUDA graphs captured)" if self.graphs is not None else "",
            "" if cache is None else f" ({self.cache_counts} in {cache.path})",
        )
        return self.compile_seconds

    def start_background(
        self, kv_caches: list[torch.Tensor], cache: CompileCache, config: ModelConfig
    ) -> None:
        """Load the packages `cache` holds now and compile the others in a child process
        (CPU only): until a bucket's package is adopted (`runs`), its steps run eager."""
        assert kv_caches[0].device.type == "cpu", "background compiles make CPU packages"
        start = time.perf_counter()
        self.cache = cache
        self.packages, self.cache_counts = load_packages(
            self.model, self.buckets, kv_caches, cache, compile_missing=False
        )
        self.num_compiles += len(self.packages)
        self.compile_seconds = time.perf_counter() - start
        missing = tuple(s for s in self.buckets if s not in self.packages)
        log.info("decode buckets %s loaded, %s compiling in the background (%s)",
                 sorted(self.packages), list(missing), cache.path)  # fmt: skip
        if missing:
            cache.path.mkdir(parents=True, exist_ok=True)
            key = cache.key
            job = CompileJob(config, key.flags, str(cache.root), key.digest(), key.threads, 0)
            load = functools.partial(self._load_package, cache)
            self.background = BackgroundCompile(job, missing, load, self.ready)

    def _load_package(self, cache: CompileCache, size: int) -> DecodePackage:
        return DecodePackage(package_file(cache.path, size), self.model)

    def _compile_buckets(self, kv_caches: list[torch.Tensor]) -> None:
        device = kv_caches[0].device
        # Dynamo keeps up to recompile_limit graphs per function (8 by default), and every
        # bucket of every engine in this process is one.
        with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=MAX_GRAPHS):
            for size in self.buckets:
                ids = torch.zeros(size, dtype=torch.int64, device=device)
                self.logits(ids, torch.zeros_like(ids), _null_metadata(device), kv_caches)
            if device.type == "cuda" and self.max_blocks_per_seq is not None:
                self.graphs = cuda_graphs.DecodeGraphs(
                    self._step, self.buckets, self.max_blocks_per_seq, kv_caches
                )


class DecodePackage:
    """One bucket's loaded package, bound to the model's weights: `(ids, positions, attn,
    kv_caches) -> logits` of `size` rows (ids and positions padded to it)."""

    def __init__(self, path: Path, model: torch.nn.Module) -> None:
        # Run with the GIL-free runner's locking (False): steps may come from any thread.
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        names = self.loader.get_constant_fqns()
        missing = [n for n in names if n.removeprefix("model.") not in tensors]
        if missing:
            raise RuntimeError(f"{path} wants tensors the model does not have: {missing[:5]}")
        constants = {n: tensors[n.removeprefix("model.")] for n in names}
        # user_managed: the package reads the model's own tensors, which the runner keeps alive.
        self.loader.load_constants(constants, False, True, True, False)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        return self.loader.boxed_run([input_ids, positions, *attn.tensors(), *kv_caches])[0]


def load_packages(
    model: torch.nn.Module,
    buckets: tuple[int, ...],
    kv_caches: list[torch.Tensor],
    cache: CompileCache,
    compile_missing: bool = True,
) -> tuple[dict[int, DecodePackage], CacheCounts]:
    """Every bucket's package from `cache`'s folder, compiling those it lacks (or cannot
    load) unless told not to; the packages, and how many were loaded (hits) and compiled or
    left to compile (misses)."""
    packages, missing = {}, []
    for size in buckets:
        try:
            packages[size] = DecodePackage(package_file(cache.path, size), model)
        except (OSError, RuntimeError) as e:  # absent, or unreadable: made again
            if package_file(cache.path, size).exists():
                log.warning("compiling decode bucket %d again: %s", size, e)
            missing.append(size)
    if missing and compile_missing:
        compile_package = background_compile.compile_package
        cache.run(lambda: [compile_package(model, size, kv_caches, cache) for size in missing])
        packages.update({s: DecodePackage(package_file(cache.path, s), model) for s in missing})
    return packages, CacheCounts(hits=len(buckets) - len(missing), misses=len(missing))


class ReadyBuckets:
    """Where a background compile hands its packages to the engine's step (`put`, `take`), and
    where the step counts its uses of each bucket (`note`), which the compile reads to pick
    the next bucket (`most_used`). Each side holds the lock for a dict or counter operation
    only: a step never waits on a compile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uses: collections.Counter[int] = collections.Counter()
        self._ready: dict[int, DecodePackage] = {}

    def note(self, size: int) -> None:
        with self._lock:
            self._uses[size] += 1

    def take(self) -> dict[int, DecodePackage]:
        """The packages put since the last call (the caller owns them now)."""
        with self._lock:
            ready, self._ready = self._ready, {}
        return ready

    def put(self, size: int, package: DecodePackage) -> None:
        with self._lock:
            self._ready[size] = package

    def most_used(self, sizes: list[int]) -> int:
        """The bucket of `sizes` the step used most (the smallest on a tie)."""
        with self._lock:
            return max(sizes, key=lambda s: (self._uses[s], -s))


@functools.cache
def code_hash() -> str:
    """A hash of the code a compiled step is traced from: this file, the export's
    (background_compile.py, compile_child.py) and the graphs' marking (cuda_graphs.py), every
    module of the model package (the model families, their layers and the attention op with
    its fake) and of kernels/ (what a layer may call, such as the CPU linears). A CPU package
    is found by the cache's key alone, so a change to any of them must give another key; read
    here with hashlib, not inductor's helper, whose import alone costs a start seconds."""
    return hash_files(traced_files())


def traced_files() -> list[Path]:
    """The source files a compiled step is made from (see code_hash)."""
    model_dir = Path(attention.__file__).parent
    kernels_dir = Path(kernels.__file__).parent
    # *.cpp, *.h: the kernels' C++ (kernels/cpu_quant.cpp, ...), which a package calls through
    # its ops.
    kernel_sources = sorted(path for p in ("*.py", "*.cpp", "*.h") for path in kernels_dir.glob(p))
    sources = [*sorted(model_dir.glob("*.py")), *kernel_sources]
    compile_dir = Path(background_compile.__file__)
    made_by = [Path(__file__), compile_dir, compile_dir.with_name("compile_child.py")]
    return [*made_by, Path(cuda_graphs.__file__), *sources]


def hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _code_version() -> Any:
    """A post-grad pass that changes nothing; its uuid, `code_hash()`, goes into the key of
    inductor's on-disk caches, so a graph compiled against an older op is never loaded. Made
    on first use: importing torch._inductor costs a node seconds at start (and upsets Triton's
    interpreter)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class CodeVersion(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            pass

        def uuid(self) -> str:
            return code_hash()

    return CodeVersion()


def _null_metadata(device: torch.device) -> AttentionMetadata:
    """One sequence of one token in slot 0 of block 0, the null block: the pool never hands it
    out, and block tables only point at it past a sequence's end, where nothing is read."""
    i32 = {"dtype": torch.int32, "device": device}
    return AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(1, 1, **i32),
        query_start_loc=torch.tensor([0, 1], **i32),
        seq_lens=torch.ones(1, **i32),
        max_query_len=1,
        max_seq_len=1,
    )
