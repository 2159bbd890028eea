"""Structured outputs in the engine: every constraint kind in every sampling mode produces
output the constraint accepts; a grammar rebuilt from tokens already generated continues as
the original (what a decode node does); bad constraints and bad resumed tokens are
ValueErrors that name them."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from pdserve.common.engine import model_runner
from pdserve.common.engine.llm import LLM
from pdserve.common.engine.structured import allowed_from_bitmask, fill_bitmask
from pdserve.common.wire.messages import Prefill, decode, encode
from pdserve.common.wire.payloads import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
}
REGEX = r"(cat|dog)-[0-9]{2,3}"
CHOICES = ("alpha", "beta gamma", 'quote " and \\ slash')
GRAMMAR = 'root ::= "<" item ("," item)* ">"\nitem ::= [a-c]+'
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
MODES = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.3, "seed": 1},
    "top_k": {"temperature": 1.0, "top_k": 5, "seed": 2},
    "top_p": {"temperature": 1.0, "top_p": 0.8, "seed": 3},
    "min_p": {"temperature": 1.0, "min_p": 0.2, "seed": 4},
    "unseeded": {"temperature": 1.0},
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir("llama")), block_size=16, dtype="float32")


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)  # strict: a raw control character would fail here
        return set(value) == set(SCHEMA["properties"]) and 0 <= value["n"] <= 99
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"<[a-c]+(,[a-c]+)*>", text) is not None


def test_params_take_exactly_one_constraint_and_travel_on_the_wire():
    with pytest.raises(ValueError, match=r"exactly one of .* \(got json, regex\)"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{oops")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=())
    for so in CONSTRAINTS.values():
        params = SamplingParams(max_tokens=4, structured_outputs=so)
        assert decode(encode(Prefill("r", (1,), params))).sampling == params
    # The schema keeps its property order: the output follows it.
    assert StructuredOutputsParams(json=SCHEMA).json == json.dumps(SCHEMA, separators=(",", ":"))


@pytest.mark.parametrize("mode", list(MODES))
def test_every_constraint_holds_in_every_sampling_mode(llm, mode):
    prompts = ["Answer:", "A longer prompt, so that the model has something to say:"]
    finished = 0
    for kind, so in CONSTRAINTS.items():
        params = SamplingParams(max_tokens=80, structured_outputs=so, **MODES[mode])
        for out in llm.generate(prompts, params):
            if out.finish_reason == "stop":
                finished += 1
                assert valid(kind, out.text), (kind, mode, out.text)
            else:  # cut off: still a prefix the grammar accepted
                assert out.finish_reason == "length", (kind, out.finish_reason)
    assert finished >= 6, "most outputs must end inside max_tokens to be checked"


def test_a_batch_mixing_constrained_and_free_requests_keeps_every_mask(llm):
    """Constrained and free requests sampled in the same steps: the mask covers only some rows
    of the batch (bitmask rows to their requests' logits rows). Each constrained output follows
    its own constraint, and the free ones are what they are alone."""
    prompts = ["Answer:", "Say something:", "Describe it:", "Once upon a time"]
    params = [
        SamplingParams(max_tokens=40, structured_outputs=CONSTRAINTS["regex"], **MODES["greedy"]),
        SamplingParams(max_tokens=12, **MODES["greedy"]),
        SamplingParams(max_tokens=40, structured_outputs=CONSTRAINTS["grammar"], **MODES["top_p"]),
        SamplingParams(max_tokens=12, **MODES["temperature"]),
    ]
    outs = llm.generate(prompts, params)
    for out, kind in ((outs[0], "regex"), (outs[2], "grammar")):
        assert out.finish_reason == "stop" and valid(kind, out.text), (kind, out.text)
    for i in (1, 3):
        (alone,) = llm.generate([prompts[i]], params[i])
        assert outs[i].token_ids == alone.token_ids, i


def test_a_grammar_rebuilt_from_generated_tokens_goes_on_the_same(llm):
    """A decode node gets the prefill node's first token (or a resumed request its streamed
    ones) and rebuilds the matcher from them: the rest equals the uninterrupted output."""
    prompt = "Describe it:"
    for kind in ("json", "grammar", "regex"):
        params = SamplingParams(
            max_tokens=80, temperature=0.0, structured_outputs=CONSTRAINTS[kind]
        )
        (full,) = llm.generate([prompt], params)
        assert len(full.token_ids) > 3
        for cut in (1, len(full.token_ids) // 2):
            engine = llm.engine
            ids = llm.tokenizer.encode(prompt)
            engine.add_request(
                f"resume-{kind}-{cut}", ids, params, output_token_ids=full.token_ids[:cut]
            )
            tokens = list(full.token_ids[:cut])
            while engine.has_unfinished:
                for update in engine.step():
                    tokens += update.new_token_ids
            assert tokens == full.token_ids, (kind, cut)


def test_tokens_that_break_the_grammar_cannot_be_resumed(llm):
    params = SamplingParams(max_tokens=8, structured_outputs=CONSTRAINTS["regex"])
    bad = llm.tokenizer.encode("zzz")
    with pytest.raises(ValueError, match="does not follow structured_outputs.regex"):
        llm.engine.add_request("bad-resume", [5, 6], params, output_token_ids=bad)


@pytest.mark.parametrize(
    "so, fragment",
    [
        (StructuredOutputsParams(json={"type": "object", "properties": 3}), "json"),
        (StructuredOutputsParams(regex="(ab"), "regex"),
        (StructuredOutputsParams(grammar='start ::= "a"'), "grammar"),
        (StructuredOutputsParams(json={"type": "nonsense"}), "json"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_it(llm, so, fragment):
    params = SamplingParams(max_tokens=4, structured_outputs=so)
    free = llm.engine.kv.num_free_blocks
    with pytest.raises(ValueError, match=f"structured_outputs.{fragment} does not compile"):
        llm.engine.add_request("bad-grammar", [5, 6], params)
    assert llm.engine.kv.num_free_blocks == free and not llm.engine.scheduler.requests


def test_json_never_allows_a_raw_control_character(llm):
    grammar = llm.engine.structured.grammar(CONSTRAINTS["json_object"])
    bitmask = fill_bitmask([grammar], llm.engine.runner.arch.vocab_size)
    allowed = allowed_from_bitmask(bitmask, llm.engine.runner.arch.vocab_size)[0]
    vocab = llm.engine.structured._info.decoded_vocab
    control = [t for t, b in enumerate(vocab) if any(c < 0x20 for c in bytes(b))]
    assert control, "the tiny tokenizer has byte tokens below 0x20"
    assert not allowed[control].any()
    hot = SamplingParams(
        max_tokens=80, temperature=2.0, seed=7, structured_outputs=CONSTRAINTS["json"]
    )
    for out in llm.generate(["{"] * 4, hot):
        assert not any(ord(ch) < 0x20 for ch in out.text), repr(out.text)


def test_bitmask_rows_unpack_to_token_flags():
    words = torch.tensor([[0b1011, -1], [0, -(1 << 31)]], dtype=torch.int32)
    got = allowed_from_bitmask(words, 40)
    want = torch.zeros(2, 40, dtype=torch.bool)
    want[0, [0, 1, 3]] = True
    want[0, 32:40] = True
    assert torch.equal(got, want)  # token 63 (row 1) is beyond the vocabulary


@pytest.mark.parametrize("overlap", [True, False])
def test_the_mask_is_filled_beside_the_forward_when_asked(llm, monkeypatch, overlap):
    """On an accelerator the mask fills on a worker while the forward runs; on the CPU
    (overlap off, the default there) before it, on the loop's thread."""
    monkeypatch.setattr(llm.engine.runner, "overlap_masks", overlap)
    threads = []

    def recording(grammars, vocab_size):
        threads.append(threading.current_thread().name)
        return fill_bitmask(grammars, vocab_size)

    monkeypatch.setattr(model_runner, "fill_bitmask", recording)
    params = SamplingParams(max_tokens=3, temperature=0.0, structured_outputs=CONSTRAINTS["regex"])
    llm.generate(["x"], params)
    assert threads and all(t.startswith("grammar-mask") == overlap for t in threads)
    assert llm.engine.runner.overlap_masks is overlap
