"""The GGUF tensor table read from the header alone (common/model/gguf_index.py): the same
names, types, shapes, offsets and sizes as gguf's own reader, over a file with a tokenizer
(string arrays), mixed types and a custom alignment; a clear error for what it cannot read; and
the quantized loader no longer holding the file mapped while it reads."""

from __future__ import annotations

import gc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from pdserve.common.model.gguf import read_raw_tensors
from pdserve.common.model.gguf_index import tensor_index
from tests.common.model.test_gguf import write_llama_gguf


def reference(path: Path) -> tuple[str, list[tuple]]:
    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    rows = [
        (t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.data_offset),
         int(t.n_bytes))
        for t in reader.tensors
    ]  # fmt: skip
    return arch, rows


def check(path: Path) -> set[str]:
    """Assert the index equals gguf's reader on `path`; the tensor types it holds."""
    arch, infos = tensor_index(path)
    want_arch, want = reference(path)
    assert arch == want_arch == "llama"
    assert [(i.name, i.qtype_name, i.shape, i.offset, i.n_bytes) for i in infos] == want
    return {i.qtype_name for i in infos}


def test_the_index_of_a_model_equals_ggufs_reader(tiny_model_dir, tmp_path: Path) -> None:
    types = lambda name: Q.Q4_1 if ".mlp." in name else Q.Q8_0  # noqa: E731
    path = write_llama_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", types)
    assert check(path) == {"Q4_1", "Q8_0", "F32"}


def test_a_custom_alignment_and_every_metadata_type(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_token_list(["a", "bc", "\u00e9"])  # an array of strings
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_float32("test.f", 0.5)
    w.add_bool("test.b", True)
    w.add_tensor("x", np.arange(15, dtype=np.float32).reshape(3, 5))
    rows = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("y", gguf.quants.quantize(rows, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert check(path) == {"F32", "Q8_0"}
    assert all(i.offset % 64 == 0 for i in tensor_index(path)[1])


def test_what_it_cannot_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        tensor_index(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 1"):
        tensor_index(path)
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + bytes(4))
    with pytest.raises(ValueError, match="ends early"):
        tensor_index(path)


def _peak_mib(run: object) -> float:
    """MiB the process's peak RSS rose above its RSS while `run()` ran."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from VmRSS
    before = status("VmRSS")
    run()
    return (status("VmHWM") - before) / 1024


def test_reading_the_blocks_does_not_map_the_whole_file(tmp_path: Path) -> None:
    """gguf's reader maps the file, and listing its tensors left every page it touched
    resident until the reader went (SmolLM2: the load's peak was 168 MiB above its start, the
    finished engine 158 with its KV pool). Read through the header's table, one tensor's
    blocks at a time, the peak is a couple of tensors, not the 32 MiB file."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list([f"token{i}" for i in range(50_000)])
    for i in range(8):
        w.add_tensor(f"t{i}", np.full((1024, 1024), i, dtype=np.float32))  # 4 MiB each
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    seen: list[tuple] = []

    def read() -> None:
        for raw in read_raw_tensors(path, [], 1, 1, 1):
            seen.append(
                (raw.name, raw.qtype_name, raw.shape, float(raw.blocks[-1].view("<f4")[-1]))
            )

    peak = _peak_mib(read)
    assert seen == [(f"t{i}", "F32", (1024, 1024), float(i)) for i in range(8)]
    assert peak < 14, f"{peak:.1f} MiB"  # two 4 MiB tensors and the reading's small change
