"""IncrementalDetokenizer against full decodes, on a byte-level BPE trained in the test."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.router.generation import IncrementalDetokenizer

WORDS = ["héllo", "wörld", "你好", "🙂", "the", "quick", "fox", "naïve", "señor", "ok", "!"]
CORPUS = ["the quick brown fox jumps over the lazy dog"] * 20 + [" ".join(WORDS)]
EOS = "<|eos|>"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    # A small vocabulary spent on ASCII merges leaves the multi-byte characters as raw bytes,
    # so their encodings split one character across several tokens.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)


def _stream(
    tokenizer: PreTrainedTokenizerFast,
    prompt: list[int],
    output: list[int],
    rng: random.Random,
    skip_special_tokens: bool = True,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Pushes output in random chunks of 1 to 3 tokens; returns all deltas, flush last."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas, start = [], 0
    while start < len(output):
        size = rng.choice((1, 2, 3))
        deltas.append(detok.push(output[start : start + size]))
        start += size
    deltas.append(detok.flush())
    return deltas, detok


def _random_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def test_multibyte_characters_really_split(tokenizer: PreTrainedTokenizerFast) -> None:
    # Guards the other tests: they only exercise hold-back if single tokens are partial chars.
    ids = tokenizer.encode("你好🙂")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_deltas_of_valid_text_concatenate_to_full_decode(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    rng = random.Random(0)
    for _ in range(200):
        prompt = tokenizer.encode(_random_text(rng))
        output = tokenizer.encode(" " + _random_text(rng))
        deltas, detok = _stream(tokenizer, prompt, output, rng)
        full = tokenizer.decode(output, skip_special_tokens=True)
        assert "".join(deltas) == full == detok.text
        assert not any("\ufffd" in d for d in deltas), deltas


def test_random_ids_concatenate_to_full_decode(tokenizer: PreTrainedTokenizerFast) -> None:
    # Random ids include lone and misordered UTF-8 bytes: the full text has U+FFFD too.
    rng = random.Random(1)
    vocab = len(tokenizer)
    for _ in range(200):
        prompt = tokenizer.encode(_random_text(rng))
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        deltas, detok = _stream(tokenizer, prompt, output, rng)
        assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True)
        assert detok.text == "".join(deltas)


def test_partial_character_is_held_until_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    output = tokenizer.encode("🙂")
    assert len(output) > 1
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("ok"))
    deltas = [detok.push([token]) for token in output]
    assert deltas[:-1] == [""] * (len(output) - 1)
    assert deltas[-1] == "🙂"
    assert detok.flush() == ""


def test_flush_emits_an_unfinished_character(tokenizer: PreTrainedTokenizerFast) -> None:
    first_byte = tokenizer.encode("🙂")[0]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("ok"))
    assert detok.push(tokenizer.encode("fox")) == "fox"
    assert detok.push([first_byte]) == ""
    assert detok.flush() == tokenizer.decode([first_byte])
    assert detok.text == tokenizer.decode(tokenizer.encode("fox") + [first_byte])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_when_asked(tokenizer: PreTrainedTokenizerFast, skip: bool) -> None:
    rng = random.Random(2)
    eos = tokenizer.eos_token_id
    output = tokenizer.encode("héllo 你好") + [eos] + tokenizer.encode(" fox") + [eos]
    deltas, _ = _stream(tokenizer, [eos] + tokenizer.encode("ok"), output, rng, skip)
    text = "".join(deltas)
    assert text == tokenizer.decode(output, skip_special_tokens=skip)
    assert (EOS in text) is not skip


def test_window_stays_bounded(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("ok"))
    for token in tokenizer.encode(" ".join(["the quick fox"] * 200)):
        detok.push([token])
        assert len(detok._token_ids) <= 8, "the decode window must not grow with the output"
