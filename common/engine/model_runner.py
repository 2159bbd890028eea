"""The only part of the engine that touches tensors: KV cache, flat-batch inputs, forward,
sampling."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from pdserve.common.engine.compile_cache import CompileCache, cache_root, compile_key
from pdserve.common.engine.compiled_decode import CompiledDecode, code_hash, decode_buckets
from pdserve.common.engine.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.common.engine.sampler import (
    Sampler,
    SamplingRow,
    make_generator,
    score_tokens,
    skip_draws,
)
from pdserve.common.engine.scheduler import (
    Sampled,
    SampledToken,
    ScheduledSeq,
    SchedulerOutput,
)
from pdserve.common.engine.structured import allowed_from_bitmask, fill_bitmask
from pdserve.common.engine.tensor_parallel import RankDriver, threads_per_rank
from pdserve.common.model.attention import AttentionMetadata, KVCacheSpec
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.llama import fuse_quantized
from pdserve.common.model.parallel import TPGroup, TPShard
from pdserve.common.model.registry import model_class
from pdserve.common.model.weights import load_model
from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.spec.draft_model import DraftModel, layer_caches
from pdserve.common.spec.mtp import MtpDraft
from pdserve.common.wire.messages import Message
from pdserve.common.wire.payloads import KVLayout, TokenLogprobs

log = logging.getLogger(__name__)

_PROMPT_LOGITS_ROWS = 256  # prompt positions scored at once: bounds the [rows, vocab] logits
_MASK_TIMEOUT_S = 60.0  # filling a step's grammar masks takes milliseconds; never wait forever
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LayerCall:
    """What runs inside a step's forward right after each layer wrote its K/V: `run(layer)`
    here; on the other tensor-parallel ranks, their agent's `layer_hook(args)` (so `args` is
    what they need, a message of the agent's plane: a prefill node's shipments of the step).
    `traces`: the spans the other ranks' spans of the step go under (`Step.traces`)."""

    run: Callable[[int], None] | None
    args: Message | None = None
    traces: tuple[str, ...] = ()

    @staticmethod
    def traced(call: LayerCall | None, traces: tuple[str, ...]) -> LayerCall | None:
        """`call` (None: nothing to run) that also carries the step's `traces`."""
        if not traces:
            return call
        return LayerCall(None, traces=traces) if call is None else replace(call, traces=traces)


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    """One step flattened: T tokens of B sequences, and which rows to sample."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    # [S] flat index of the last token of each sampled sequence, and of each of its drafts
    logit_indices: torch.Tensor
    sampled_seqs: tuple[ScheduledSeq, ...]
    # whether logit_indices is every token in order (a decode step: each row one, sampled)
    every_row: bool = False


def kv_block_bytes(
    arch: ModelArchConfig, spec: KVCacheSpec, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block occupies across all layers, each layer's cache as `spec` says (a
    tensor-parallel rank's share of the KV heads, or a whole latent)."""
    return spec.block_bytes(block_size, dtype) * arch.num_layers


def load_runner_model(
    config: ModelConfig, tp: TPGroup | None = None
) -> tuple[torch.nn.Module, ModelArchConfig]:
    """The model as a runner holds it: loaded (random weights for load_format dummy) and its
    projections fused for the device (a background compile's child loads the same)."""
    dummy_seed = config.seed if config.load_format == "dummy" else None
    dtype, device = _TORCH_DTYPES[config.dtype], torch.device(config.device)
    model, arch = load_model(
        config.model_dir, dtype, device, dummy_seed, tp, quantization=config.quantization
    )
    if device.type == "cuda":
        model.fuse_projections()  # wide GEMVs: decode steps read weights faster
    else:
        fuse_quantized(model)  # one packed-int4 call for q/k/v, one for gate/up
    return model, arch


class ModelRunner:
    """Loads the model, owns the paged KV cache and runs one scheduled step at a time.

    Unless model_config.decode_compile is "eager", decode steps of up to max_num_seqs
    sequences run through the compiled model (every bucket compiled here, at start, when
    "blocking"; when "background", each bucket once a child process has compiled it); other
    steps run eager.

    With `parallel.tensor_parallel_size` N > 1 this runner is rank 0 of N: it starts the
    other ranks (`tensor_parallel.RankDriver`), holds its shard of the model and of every KV
    block, and sends each step to them; sampling and per-request state live here alone. A
    worker rank is built with its `tp` group and runs `follow` for each step it receives."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        parallel: ParallelConfig | None = None,
        tp: TPGroup | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.device = torch.device(model_config.device)
        self.dtype = _TORCH_DTYPES[model_config.dtype]
        self.block_size = cache_config.block_size
        self.parallel = parallel = parallel or ParallelConfig()
        self.driver: RankDriver | None = None
        drafts_kv = speculative is not None and speculative.has_draft_kv
        if drafts_kv and speculative.method == "mtp" and parallel.tensor_parallel_size > 1:
            raise ValueError(  # before any rank process starts
                f"speculative_config: {speculative.method} runs at tensor parallel size 1 only"
            )
        if tp is None and parallel.tensor_parallel_size > 1:
            # Refuse a model that cannot split before starting any process.
            shard = TPShard(0, parallel.tensor_parallel_size, model_config.enable_expert_parallel)
            shard.check(ModelArchConfig.from_dir(model_config.model_dir))
            self.driver = RankDriver(
                model_config, cache_config, parallel, max_num_seqs, max_model_len, speculative
            )
            tp = self.driver.group
            torch.set_num_threads(threads_per_rank(parallel))  # this process is one rank
        self.tp = tp
        self.draft: DraftModel | MtpDraft | None = None  # a drafter with a page group
        # The rows of one request's verify step (1 + k), which the compiled steps take on the
        # CPU (see _compiled_step); 1 without speculation.
        self.verify_rows = 1 + speculative.num_speculative_tokens if speculative else 1
        try:
            if speculative is not None and speculative.has_draft_kv:
                self._load_draft(speculative, model_config)
            self._build(model_config, cache_config, max_num_seqs, max_model_len)
        except BaseException:
            self.close()
            raise
        if self.driver is not None:
            self.driver.start()

    def _build(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        max_num_seqs: int,
        max_model_len: int | None,
    ) -> None:
        start = time.perf_counter()
        self.model, self.arch = load_runner_model(model_config, self.tp)
        # A node's start is this load and, when it compiles, the warm-up's line after it.
        self.load_seconds = time.perf_counter() - start
        log.info("loaded %s in %.1f s", model_config.model_dir, self.load_seconds)
        shard = self.tp.shard if self.tp is not None else None
        self.kv_spec = type(self.model).kv_cache_spec(self.arch, shard)  # this rank's share
        if isinstance(self.draft, MtpDraft):
            self.draft.bind(self.model)  # it shares the target's embedding and rope
        self.num_blocks = self._pool_size(cache_config)
        shape = self.kv_spec.shape(self.num_blocks, self.block_size)
        layers = self.arch.num_layers
        self.kv_caches = layer_caches(shape, layers, self.dtype, self.device, self.draft)
        # The target's layer caches; a draft's page group follows them in kv_caches.
        self.model_caches = self.kv_caches[: self.arch.num_layers]
        self.sampler = Sampler(seed=model_config.seed, device=self.device)
        self.generators: dict[str, torch.Generator] = {}
        self._mask_worker: ThreadPoolExecutor | None = None  # started by the first grammar
        # Grammar masks are filled on a worker while the forward runs on an accelerator. On
        # the CPU the forward's own threads hold every core, so the worker can only compete
        # with them: there the mask (1.6 ms for 32 rows of SmolLM2) is filled before the
        # forward. `pdserve bench structured` measures both ways.
        self.overlap_masks = self.device.type != "cpu"
        self.compiled: CompiledDecode | None = None
        mode = model_config.decode_compile
        if mode == "background" and self.tp is not None:
            mode = "eager"  # its child would compile one rank's share alone: not written
        if mode != "eager" and self.model.compiles_decode:
            longest = min(self.arch.max_position_embeddings, self.num_blocks * self.block_size)
            if max_model_len is not None:
                longest = min(longest, max_model_len)
            width = -(-longest // self.block_size)
            buckets = step_buckets(max_num_seqs, self.verify_rows if self.compiles_verify else 1)
            self.compiled = CompiledDecode(self.model, max_num_seqs, width, buckets)
            cache = self._compile_cache(model_config)
            if mode == "background":
                self.compiled.start_background(self.model_caches, cache, model_config)
            else:
                self.compiled.warm_up(self.model_caches, cache)
        if self.device.type == "cpu":
            # The eager steps' kernels (kernels/ops.py's CPU linears); a compiling runner's packages
            # were traced over the plain model and bind its weights by name: they stay.
            self.model.use_cpu_head(keep_plain=self.compiled is not None)

    def _load_draft(self, speculative: SpeculativeConfig, model_config: ModelConfig) -> None:
        target = ModelArchConfig.from_dir(model_config.model_dir)
        if speculative.method != "mtp":
            self.draft = DraftModel(speculative, target, self.dtype, self.device, self.tp)
            return
        spec = model_class(target).kv_cache_spec(target)
        seed = model_config.seed if model_config.load_format == "dummy" else None
        args = (speculative, model_config.model_dir, target, spec, self.dtype, self.device)
        self.draft = MtpDraft(*args, seed)

    def _compile_cache(self, model_config: ModelConfig) -> CompileCache:
        """Where this model's compiled steps are kept between starts: keyed by what shapes the
        graphs (not the block-table width: only the CUDA graphs' buffers depend on it; not the
        bucket list: each bucket is its own graph, so an engine with buckets 1, 2, 4 and one
        with bucket 1 alone share bucket 1's)."""
        assert self.compiled is not None, "only a compiling runner has a compile cache"
        shard = self.tp.shard if self.tp is not None else None
        flags = {"block_size": self.block_size, "device": self.device.type, "tp": shard}
        key = compile_key(self.model, self.arch, self.dtype, flags, code_hash())
        return CompileCache(cache_root(model_config.compile_cache_dir), key)

    def _pool_size(self, cache: CacheConfig) -> int:
        """Blocks in the pool; under tensor parallelism the smallest any rank can hold (this
        collective also waits for every rank's model to load)."""
        if cache.num_blocks is not None:
            n = cache.num_blocks
        else:
            budget = cache.kv_cache_bytes
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * cache.gpu_memory_utilization)
            size = kv_block_bytes(self.arch, self.kv_spec, self.block_size, self.dtype)
            # A drafter's page group (draft_model, mtp) has pages in every block too.
            layers = self.arch.num_layers + (self.draft.num_layers if self.draft else 0)
            n = budget * self.arch.num_layers // (size * layers)
        if self.tp is not None:
            wait = self.parallel.start_timeout_s
            n = int(self.tp.all_reduce_min(torch.tensor([n], dtype=torch.int64), wait)[0])
        if n < 2:
            raise ValueError("KV cache budget too small for even one block")
        return int(n)

    def kv_layout(self, model_id: str) -> KVLayout:
        """What one page of this model's KV cache means (all its KV heads: a tensor-parallel
        rank holds a share of them), as the KV handshake and the router's pairing compare it.
        Quantized weights give other KV than the float ones: the id names their form."""
        spec = type(self.model).kv_cache_spec(self.arch)
        from pdserve.common.model.quant import weight_format  # numpy: only with quantization

        held = weight_format(self.model)
        if held:
            model_id = f"{model_id}:{held}"
        if self.draft is not None:  # its pages travel as layers after the target's
            model_id = f"{model_id}+{self.draft.layout_tag}"
        return KVLayout(
            model_id=model_id,
            dtype=str(self.dtype).removeprefix("torch."),
            num_layers=len(self.kv_caches),
            num_kv_heads=spec.heads,
            head_dim=spec.dim,
            block_size=self.block_size,
            planes=spec.planes,
        )

    def close(self) -> None:
        """Stop the other ranks, if this runner drives any, and a background compile."""
        if self.driver is not None:
            self.driver.close()
        if getattr(self, "compiled", None) is not None:  # None before the model is built
            self.compiled.close()

    @property
    def compiles_verify(self) -> bool:
        """Whether verify steps (a sequence with k drafts brings 1 + k rows) may run compiled:
        on the CPU, whose packages take any rows per sequence (the attention op is opaque and
        its metadata's sizes are dynamic); not on CUDA, whose graphs replay one row a
        sequence."""
        return self.device.type == "cpu"

    @property
    def verifies_compiled(self) -> bool:
        """Whether this runner's verify steps run compiled once their bucket is ready (what
        adaptive k's step costs are chosen by: `drafting.step_cost`)."""
        return self.compiled is not None and self.compiles_verify

    @property
    def is_driver(self) -> bool:
        """Whether this runner samples (rank 0, or the only rank)."""
        return self.tp is None or self.tp.rank == 0

    # -- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, on_layer: LayerCall | None = None
    ) -> tuple[dict[str, Sampled], dict[str, list[TokenLogprobs]]]:
        """Run the scheduled step: the sampled token of each completed sequence (the tokens
        a verify step emits, for one with drafts), and the prompt logprobs of the positions
        this step computed, for requests that asked.

        `on_layer.run(i)` is called once layer i has written this step's K/V (see the model)."""
        self.forget(output.finished_ids)
        run = on_layer.run if on_layer is not None else None
        compiled = self._compiled_step(output.seqs, run)
        inputs = self.prepare(output.seqs)
        with self.tp.lock if self.tp is not None else contextlib.nullcontext():
            if self.driver is not None:
                args = on_layer.args if on_layer is not None else None
                traces = on_layer.traces if on_layer is not None else ()
                self.driver.send_step(output.seqs, compiled, args, traces)
            plain = tuple(seq for seq in inputs.sampled_seqs if not seq.num_drafts)
            masks = self._fill_masks(plain)  # overlapped with the forward
            logits, prompt_lps = self._forward(inputs, output.seqs, run, compiled)
        if logits is None:
            return {}, prompt_lps
        sampled: dict[str, Sampled] = {}
        if plain:
            own = logits if len(plain) == len(logits) else logits[_plain_rows(inputs)]
            sampled.update(self._sample(own, plain, masks))
        row = 0
        for seq in inputs.sampled_seqs:
            if seq.num_drafts:
                part = logits[row : row + seq.num_drafts + 1]
                row_params, drafts = self._sampling_row(seq), seq.draft_token_ids
                out = self.sampler.verify(part, row_params, drafts, self._draft_mask(seq, part))
                emitted = zip(out.token_ids, out.logprobs, strict=True)
                sampled[seq.request_id] = tuple(
                    SampledToken(seq.request_id, t, lp) for t, lp in emitted
                )
            row += 1 + seq.num_drafts
        return sampled, prompt_lps

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: tuple[ScheduledSeq, ...],
        masks: tuple[list[int], Future[torch.Tensor]] | None,
    ) -> dict[str, Sampled]:
        """One token for each sequence, a row of logits each, under its grammar's mask."""
        rows = [self._sampling_row(seq) for seq in seqs]
        allowed = None
        if masks is not None:
            indices, bitmask = masks[0], masks[1].result(timeout=_MASK_TIMEOUT_S)
            allowed = indices, allowed_from_bitmask(bitmask, logits.shape[-1]).to(self.device)
        result = self.sampler(logits, rows, allowed)
        return {
            seq.request_id: SampledToken(seq.request_id, tok, lp)
            for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs)
        }

    @torch.inference_mode()
    def follow(
        self,
        seqs: tuple[ScheduledSeq, ...],
        compiled: bool,
        on_layer: Callable[[int], None] | None = None,
    ) -> None:
        """A worker rank's share of a step rank 0 sent: the same forward, joined by the
        model's collectives; what it computes stays in this rank's KV cache (and leaves it
        through `on_layer`, the rank's part of a prefill node's KV sends)."""
        self._forward(self.prepare(seqs), seqs, on_layer, compiled)

    def _forward(
        self,
        inputs: ForwardInputs,
        seqs: tuple[ScheduledSeq, ...],
        on_layer: Callable[[int], None] | None,
        compiled: bool,
    ) -> tuple[torch.Tensor | None, dict[str, list[TokenLogprobs]]]:
        """Logits [S, vocab] of the sampled rows (None when none is sampled), and the prompt
        logprobs this step computed."""
        if compiled:
            args = (inputs.input_ids, inputs.positions, inputs.attn, self.model_caches)
            logits = self.compiled.logits(*args)
            if self.draft is not None:  # mtp never runs compiled: DeepSeek decodes eager
                self.draft.run(inputs.input_ids, inputs.positions, inputs.attn, on_layer)
            if not inputs.sampled_seqs:
                return None, {}
            # A decode step samples every row: its [B, vocab] float32 logits as they are, not
            # a copy through the index (~1.5% of a 16-row CPU step). A CUDA graph's output is
            # its static buffer, overwritten by the next replay: copied out there.
            if inputs.every_row and logits.device.type == "cpu":
                return logits, {}
            return logits[inputs.logit_indices], {}
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.attn, self.model_caches, on_layer
        )
        if self.draft is not None:
            self.draft.run(inputs.input_ids, inputs.positions, inputs.attn, on_layer, hidden)
        prompt_lps = self._score_prompts(hidden, seqs)
        if not inputs.sampled_seqs:
            return None, prompt_lps
        return self.model.compute_logits(hidden[inputs.logit_indices]), prompt_lps

    def _compiled_step(
        self, seqs: tuple[ScheduledSeq, ...], on_layer: Callable[[int], None] | None
    ) -> bool:
        """A pure decode step the compiled model takes: one known token per sequence and its
        drafts (where `compiles_verify`), a bucket that holds its rows (compiled by now), no
        prompt logprobs and no per-layer hook (a prefill node's KV sends). Buckets count
        rows, not sequences: a verify step of one request with 5 drafts runs bucket 8."""
        drafts = self.compiles_verify
        return (
            self.compiled is not None
            and on_layer is None
            and all(_decodes(seq, drafts) for seq in seqs)
            and self.compiled.runs(sum(len(seq.token_ids) for seq in seqs))
        )

    def _score_prompts(
        self, hidden: torch.Tensor, seqs: tuple[ScheduledSeq, ...]
    ) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of the prompt tokens that follow this step's positions, a bounded slice of
        positions at a time (never the logits of a whole prompt at once)."""
        out: dict[str, list[TokenLogprobs]] = {}
        offset = 0
        for seq in seqs:
            if seq.prompt_targets:
                row = offset + seq.prompt_target_pos - seq.start_pos
                lps = out[seq.request_id] = []
                targets = seq.prompt_targets
                for lo in range(0, len(targets), _PROMPT_LOGITS_ROWS):
                    part = targets[lo : lo + _PROMPT_LOGITS_ROWS]
                    logits = self.model.compute_logits(hidden[row + lo : row + lo + len(part)])
                    if self.is_driver:  # the other ranks only join the logits' gather
                        lps += score_tokens(logits, part, seq.prompt_logprobs)
            offset += len(seq.token_ids)
        return out

    def _draft_mask(self, seq: ScheduledSeq, logits: torch.Tensor) -> torch.Tensor | None:
        """[k + 1, V] bool: what a drafted request's grammar allows at each verified position
        (None without a grammar). Filled after the forward, unlike `_fill_masks`: a CPU
        node fills before the forward anyway, and a verify step's rows are few."""
        if seq.grammar is None:
            return None
        vocab = logits.shape[-1]
        bitmask = fill_bitmask([seq.grammar], self.arch.vocab_size, [seq.draft_token_ids])
        return allowed_from_bitmask(bitmask, vocab).to(self.device)

    def _fill_masks(
        self, seqs: tuple[ScheduledSeq, ...]
    ) -> tuple[list[int], Future[torch.Tensor]] | None:
        """Start filling the grammar bitmask of every sampled row that has a grammar: the
        rows, and the bitmask to come (None when no row is constrained)."""
        indices = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not indices:
            return None
        grammars = [seqs[i].grammar for i in indices]
        if not self.overlap_masks:
            done: Future[torch.Tensor] = Future()
            done.set_result(fill_bitmask(grammars, self.arch.vocab_size))
            return indices, done
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return indices, self._mask_worker.submit(fill_bitmask, grammars, self.arch.vocab_size)

    def forget(self, request_ids: tuple[str, ...]) -> None:
        """Drop per-request state (seeded generators) of requests that ended."""
        for rid in request_ids:
            self.generators.pop(rid, None)

    def _sampling_row(self, seq: ScheduledSeq) -> SamplingRow:
        generator = None
        if seq.sampling.seed is not None:
            generator = self.generators.get(seq.request_id)
            if generator is None:
                generator = make_generator(seq.sampling.seed, self.device)
                # A request that arrives with tokens already sampled elsewhere (a decode node
                # continuing after the prefill node's first token) continues the same stream.
                skip_draws(generator, seq.num_output_tokens, self.arch.vocab_size)
                self.generators[seq.request_id] = generator
        return SamplingRow(seq.sampling, generator, seq.banned_token_ids)

    def prepare(self, seqs: tuple[ScheduledSeq, ...]) -> ForwardInputs:
        """Flatten scheduled sequences into the model's inputs (host lists, one copy each)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        logit_indices: list[int] = []
        for seq in seqs:
            n = len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            pos = range(seq.start_pos, seq.start_pos + n)
            positions.extend(pos)
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in pos)
            starts.append(starts[-1] + n)
            seq_lens.append(seq.start_pos + n)
            if seq.sample:
                logit_indices.extend(range(starts[-1] - 1 - seq.num_drafts, starts[-1]))
        width = max(len(seq.block_ids) for seq in seqs)
        tables = [list(seq.block_ids) + [0] * (width - len(seq.block_ids)) for seq in seqs]
        longs = self._to_device([input_ids, positions, slots, logit_indices], torch.int64)
        ints = self._to_device([starts, seq_lens, [b for row in tables for b in row]], torch.int32)
        attn = AttentionMetadata(
            slot_mapping=longs[2],
            block_tables=ints[2].view(len(seqs), width),
            query_start_loc=ints[0],
            seq_lens=ints[1],
            max_query_len=max(len(s.token_ids) for s in seqs),
            max_seq_len=max(seq_lens),
        )
        return ForwardInputs(
            input_ids=longs[0],
            positions=longs[1],
            attn=attn,
            logit_indices=longs[3],
            sampled_seqs=tuple(seq for seq in seqs if seq.sample),
            every_row=len(logit_indices) == len(input_ids),  # indices rise: then all, in order
        )

    def _to_device(self, lists: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Host lists as device tensors of one dtype: one host buffer and, on an accelerator,
        one copy from pinned memory that does not wait for the device (torch's caching host
        allocator keeps the buffer alive until the copy is done)."""
        if self.device.type == "cpu":
            return [torch.tensor(part, dtype=dtype) for part in lists]
        flat = torch.tensor([x for part in lists for x in part], dtype=dtype).pin_memory()
        return list(flat.to(self.device, non_blocking=True).split([len(p) for p in lists]))


def step_buckets(max_num_seqs: int, verify_rows: int = 1) -> tuple[int, ...]:
    """The compiled steps' buckets, in rows: a plain step's (one row a sequence, up to
    max_num_seqs) and, with speculation, the powers of two up to one request's verify step
    (`verify_rows`), so that it runs compiled even where max_num_seqs is smaller (batch 1)."""
    verify = decode_buckets(1 << (verify_rows - 1).bit_length()) if verify_rows > 1 else ()
    return tuple(sorted({*decode_buckets(max_num_seqs), *verify}))


def _decodes(seq: ScheduledSeq, drafts: bool) -> bool:
    """Whether a scheduled sequence is a decode row (with its drafts, where `drafts`)."""
    known = len(seq.token_ids) - (seq.num_drafts if drafts else 0)
    return known == 1 and not seq.prompt_targets


def _plain_rows(inputs: ForwardInputs) -> list[int]:
    """The logits rows of the sampled sequences without drafts (one row each; a sequence
    with drafts has one more per draft)."""
    rows, row = [], 0
    for seq in inputs.sampled_seqs:
        if not seq.num_drafts:
            rows.append(row)
        row += 1 + seq.num_drafts
    return rows
