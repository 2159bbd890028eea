"""`pdserve bench structured`: what a grammar costs per decode step. The same batch on the
offline engine, decode steps timed with no constraint, with a JSON-schema mask filled before the
forward, and with one filled on a worker thread beside it; and the fill alone."""

from __future__ import annotations

import statistics
import time
from typing import Any

from pdserve.bench.report import (
    add_flags,
    add_output_flags,
    describe_machine,
    machine,
    outputs_from_args,
    records_table,
    save_json,
    write_section,
)
from pdserve.common.engine import model_runner
from pdserve.common.engine.llm import LLM
from pdserve.common.node.cli import parser
from pdserve.common.wire.payloads import SamplingParams, StructuredOutputsParams
from pdserve.models import smollm2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "favorite_color": {"enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "favorite_color", "hobbies", "address"],
}


class FillTimer:
    """Wraps the runner's mask fill to add up the worker's time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._fill = model_runner.fill_bitmask

    def __call__(self, grammars, vocab_size):
        start = time.perf_counter()
        try:
            return self._fill(grammars, vocab_size)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def __enter__(self) -> FillTimer:
        model_runner.fill_bitmask = self
        return self

    def __exit__(self, *_: object) -> None:
        model_runner.fill_bitmask = self._fill


def decode_steps(llm: LLM, batch: int, steps: int, constrained: bool) -> tuple[list[float], float]:
    """Step times (s) of `steps` decode steps of `batch` requests, and the worker's fill time
    per step (s)."""
    tok = llm.tokenizer
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    # Long enough that no request ends within the timed steps, constrained or not.
    params = SamplingParams(
        max_tokens=steps + 8, temperature=0.0, ignore_eos=True, structured_outputs=so
    )
    engine = llm.engine
    for i in range(batch):
        text = f"Invent person number {i} and describe them in JSON."
        chat = [{"role": "user", "content": text}]
        ids = tok(
            tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ).input_ids
        engine.add_request(f"bench-{constrained}-{batch}-{i}", ids, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token) of every request
    times = []
    with FillTimer() as fill:
        for _ in range(steps):
            start = time.perf_counter()
            updates = engine.step()
            times.append(time.perf_counter() - start)
            assert len(updates) == batch, "a request ended inside the timed steps"
    while engine.has_unfinished:
        engine.step()
    return times, fill.seconds / max(fill.calls, 1)


def run(model: str, batches: list[int], steps: int, repeats: int = 3) -> list[dict]:
    llm = LLM(model, max_num_seqs=max(batches), max_num_batched_tokens=2048)
    decode_steps(llm, 1, 4, True)  # warm up: compile the schema, scan the tokenizer
    runner = llm.engine.runner
    default = runner.overlap_masks
    rows = []
    for batch in batches:
        times: dict[str, list[float]] = {"plain": [], "first": [], "worker": []}
        fills = []
        for _ in range(repeats):  # alternated, so drifts of the machine hit every mode alike
            times["plain"].append(statistics.median(decode_steps(llm, batch, steps, False)[0]))
            for mode in ("first", "worker"):
                runner.overlap_masks = mode == "worker"
                step_times, fill = decode_steps(llm, batch, steps, True)
                times[mode].append(statistics.median(step_times))
                fills.append(fill)
        runner.overlap_masks = default
        base = min(times["plain"])
        row = {"batch": batch, "step_ms": base * 1e3, "fill_ms": min(fills) * 1e3}
        for mode in ("first", "worker"):
            t = min(times[mode])
            row[f"{mode}_ms"] = t * 1e3
            row[f"{mode}_overhead_ms"] = (t - base) * 1e3
            row[f"{mode}_share"] = (t - base) / t
        rows.append(row)
    return rows


def _ms_and_share(mode: str) -> Any:
    return lambda r: f"{r[f'{mode}_overhead_ms']:.1f} ms ({r[f'{mode}_share']:.1%})"


COLUMNS = [
    ("batch", "batch"),
    ("no grammar (ms)", lambda r: f"{r['step_ms']:.1f}"),
    ("mask filled first (ms)", lambda r: f"{r['first_ms']:.1f}"),
    ("overhead", _ms_and_share("first")),
    ("mask on a worker beside the forward (ms)", lambda r: f"{r['worker_ms']:.1f}"),
    ("overhead", _ms_and_share("worker")),
    ("fill alone (share of the step)",
     lambda r: f"{r['fill_ms']:.2f} ms ({r['fill_ms'] / r['step_ms']:.1%})"),
]  # fmt: skip
FLAGS = [
    ("--model", str, None, "checkpoint (default: SmolLM2-135M-Instruct)"),
    ("--batches", int, [1, 32], "decode batch sizes", {"nargs": "+"}),
    ("--steps", int, 24, "timed decode steps per batch"),
    ("--repeats", int, 3, "alternated runs; the best counts"),
]
READING = (
    "`pdserve bench structured --steps 24 --repeats 5` made it. Decode step times; overhead "
    "against the step without a grammar (negative: within the machine's noise). On the CPU "
    "the forward's threads hold every core and a worker beside them can only compete with "
    "them, so CPU nodes fill the mask before the forward; on an accelerator they fill it on a "
    "worker while the forward runs."
)


def main(argv: list[str] | None = None) -> None:
    p = parser("pdserve bench structured", __doc__.split("\n\n")[0])
    add_flags(p.add_argument_group("run"), FLAGS)
    add_output_flags(p, "structured.json")
    args = p.parse_args(argv)
    to = outputs_from_args(p, args)
    rows = run(args.model or str(smollm2()), args.batches, args.steps, args.repeats)
    text = records_table(COLUMNS, rows)
    print(text)
    save_json(to.folder / "structured.json", {"machine": machine(), "rows": rows})
    setup = (
        f"{describe_machine(machine())}. SmolLM2-135M-Instruct (float32), greedy, a JSON schema "
        "with nested objects, an enum, bounded strings and a list; the best of "
        f"{args.repeats} alternated runs of the median of {args.steps} decode steps, every "
        "column from the same run."
    )
    title = "## Structured outputs: the grammar mask per decode step"
    body = "\n\n".join([title, setup, text, READING])
    print(f"wrote {write_section('structured', body, to.page)}")


if __name__ == "__main__":
    main()
