"""GGUF loading on small files the tests write with the `gguf` library itself: every tensor type
against the library's own dequantization, the errors that name what is unsupported, and a tiny
random Llama written as llama.cpp's converter writes it, which must run exactly as its
safetensors original."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="gguf is a pdserve dependency: install pdserve")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.common.model.checkpoint import Checkpoint  # noqa: E402
from pdserve.common.model.config import ModelArchConfig  # noqa: E402
from pdserve.common.model.gguf import (  # noqa: E402
    dequantize,
    permute_rotary,
    read_tensors,
    unpermute_rotary,
)
from tests.common.model.gguf_blocks import encode  # noqa: E402

QUANT_TYPES = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def write_tensors(writer: gguf.GGUFWriter, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    """Each (array, type): a float array converted to its type (`encode`; F32 as it is), an
    integer one (I32) written as it is; then the header, the metadata and the tensors, and close."""
    for name, (array, qtype) in tensors.items():
        data = encode(array, qtype) if array.dtype.kind == "f" else array
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    write_tensors(gguf.GGUFWriter(str(path), arch), tensors)
    return path


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_every_type_reads_as_the_library_dequantizes_it(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((8, 64)).astype(np.float32)  # HF orientation: (out, in)
    vector = rng.standard_normal(64).astype(np.float32)
    path = _write(tmp_path / "t.gguf", "llama", {"m.weight": (matrix, qtype), "v": (vector, Q.F32)})
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    got = dequantize(tensors["m.weight"])
    expected = gguf.quants.dequantize(gguf.quants.quantize(matrix, qtype), qtype)
    assert got.dtype == np.float32 and got.shape == matrix.shape
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(dequantize(tensors["v"]), vector)
    # The quantization itself is lossy but close: a wrong block layout would not be.
    assert np.abs(got - matrix).max() < {Q.F32: 1e-9, Q.F16: 1e-2, Q.Q8_0: 0.05, Q.Q4_1: 0.5}[qtype]


def test_an_unsupported_quantization_type_is_named(tmp_path: Path) -> None:
    ints = np.arange(64, dtype=np.int32).reshape(4, 16)
    path = _write(tmp_path / "t.gguf", "llama", {"blk.0.attn_q.weight": (ints, Q.I32)})
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*unsupported .*type I32"):
        dequantize(tensor)


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.gguf", "gemma", {"x": (np.zeros(4, np.float32), Q.F32)})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        Checkpoint.resolve(path).hf_config()
    with pytest.raises(ValueError, match="'gemma'"):
        list(read_tensors(path, [], 1, 1, 1))


def test_resolving_a_model_path(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "llama", {"x": (np.zeros(4, np.float32), Q.F32)})
    assert Checkpoint.resolve(path) == Checkpoint(tmp_path, "m.gguf")
    assert Checkpoint.resolve(tmp_path) == Checkpoint(tmp_path, "m.gguf")  # a dir holding one
    _write(tmp_path / "n.gguf", "llama", {"x": (np.zeros(4, np.float32), Q.F32)})
    with pytest.raises(ValueError, match="several .gguf"):
        Checkpoint.resolve(tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        Checkpoint.resolve(tmp_path / "missing")
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="must be a .gguf"):
        Checkpoint.resolve(tmp_path / "w.bin")
    (tmp_path / "n.gguf").unlink()
    (tmp_path / "config.json").write_text("{}")
    assert Checkpoint.resolve(tmp_path) == Checkpoint(tmp_path, "m.gguf")  # its only weights
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert Checkpoint.resolve(tmp_path) == Checkpoint(tmp_path)  # an HF directory
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        Checkpoint.resolve(tmp_path)


def test_rotary_unpermute_inverts_the_converters_permutation() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)  # 8 heads of dim 16
    permuted = permute_rotary(w, 8)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rotary(permuted, 8), w)
    # llama.cpp's order: within a head, row j of the first half is followed by its rotary
    # partner j + d/2.
    np.testing.assert_array_equal(permuted[:2], w[[0, 8]])


def add_model_metadata(w: gguf.GGUFWriter, arch: ModelArchConfig) -> None:
    """The shape fields every llama.cpp architecture writes (under the writer's arch)."""
    w.add_block_count(arch.num_layers)
    w.add_context_length(arch.max_position_embeddings)
    w.add_embedding_length(arch.hidden_size)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(arch.num_heads)
    w.add_head_count_kv(arch.num_kv_heads)
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    w.add_rope_freq_base(arch.rope_theta)
    w.add_vocab_size(arch.vocab_size)


def add_gpt2_tokenizer(w: gguf.GGUFWriter, model_dir: Path) -> None:
    """The checkpoint's BPE tokenizer as llama.cpp's "gpt2" tokenizer metadata."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    tokens = [added.get(i, t) for t, i in vocab]
    tokens += [added[i] for i in sorted(added) if i >= len(vocab)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    config = json.loads((model_dir / "config.json").read_text())
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])


def write_llama_gguf(
    model_dir: Path,
    out: Path,
    qtype: Q | Callable[[str], Q] = Q.F32,
    change: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> Path:
    """A Llama HF directory written as llama.cpp's converter writes it: metadata, a gpt2 BPE
    tokenizer, q/k rows permuted, 2-D weights in `qtype` (or `qtype(HF name)`; norms stay F32),
    each weight first passed through `change(HF name, array)` when given."""
    arch = ModelArchConfig.from_dir(model_dir)
    w = gguf.GGUFWriter(str(out), "llama")
    add_model_metadata(w, arch)
    w.add_rope_dimension_count(arch.head_dim)
    add_gpt2_tokenizer(w, model_dir)
    w.add_chat_template((model_dir / "chat_template.jinja").read_text())
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, arch.num_layers)
    tensors = {}
    for name, array in load_file(model_dir / "model.safetensors").items():
        array = array.astype(np.float32)
        if change is not None:
            array = change(name, array)
        if name.endswith("q_proj.weight"):
            array = permute_rotary(array, arch.num_heads)
        elif name.endswith("k_proj.weight"):
            array = permute_rotary(array, arch.num_kv_heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        t = (qtype if isinstance(qtype, Q) else qtype(name)) if array.ndim == 2 else Q.F32
        tensors[gguf_name] = (array, t)
    write_tensors(w, tensors)
    return out


def test_a_tiny_llama_as_gguf_reads_back_the_same_weights(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    path = write_llama_gguf(model_dir, tmp_path / "tiny.gguf")
    original = load_file(model_dir / "model.safetensors")
    arch = ModelArchConfig.from_dir(model_dir)
    got = dict(read_tensors(path, original, arch.num_layers, arch.num_heads, arch.num_kv_heads))
    assert got.keys() == original.keys()
    for name, array in original.items():
        np.testing.assert_array_equal(got[name], array.astype(np.float32), err_msg=name)
    # transformers' own GGUF reader (its own q/k un-permutation) sees the original too: the
    # file is as llama.cpp's converter writes it, so the loader's inverse is the right one.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    hf_state = hf.state_dict()
    for name, array in original.items():
        np.testing.assert_array_equal(hf_state[name].numpy(), array, err_msg=name)


def test_a_tiny_llama_as_gguf_generates_as_its_original(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    path = write_llama_gguf(model_dir, tmp_path / "tiny.gguf")
    got, want_arch = ModelArchConfig.from_dir(path), ModelArchConfig.from_dir(model_dir)
    # GGUF stores eps as float32, and the tokenizer's eos only (no generation_config.json).
    assert got.rms_norm_eps == pytest.approx(want_arch.rms_norm_eps, rel=1e-6)
    assert set(got.eos_token_ids) <= set(want_arch.eos_token_ids)
    same = {"rms_norm_eps": got.rms_norm_eps, "eos_token_ids": got.eos_token_ids}
    assert got == dataclasses.replace(want_arch, **same)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The quick brown fox", "Once upon a time"]
    reference, llm = LLM(str(model_dir), dtype="float32"), LLM(str(path), dtype="float32")
    encode = lambda m: [m.tokenizer.encode(p) for p in prompts]  # noqa: E731
    assert encode(llm) == encode(reference)  # the tokenizer came through the metadata
    want = [o.token_ids for o in reference.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
