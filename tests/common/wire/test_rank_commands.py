"""Commands between a node's rank 0 and its ranks: typed messages of a plane, refused with a
reason when they are not, and nothing else on that path (no method named by a string, no
list of anything for a payload)."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest

from pdserve.common.engine.scheduler import ScheduledSeq
from pdserve.common.engine.tensor_parallel import STEPS, Step
from pdserve.common.wire.messages import PROTOCOL_VERSION, Abort, Message, encode
from pdserve.common.wire.payloads import SamplingParams
from pdserve.common.wire.ranks import Count, Done, RankCommandError, Refused, answer
from pdserve.kv_transfer.commands import KV_RANKS, Cancel, Expect, ShipKV, Shipment
from pdserve.kv_transfer.ranks import RankKV

ROOT = Path(__file__).resolve().parents[3]


def expect(cmd: Expect) -> Count:
    if cmd.src_tp > 8:
        raise ValueError("no such prefill group")
    return Count(len(cmd.block_ids))


HANDLERS = {Expect: expect}


def raw(body: dict) -> bytes:
    return msgpack.packb({**body, "version": PROTOCOL_VERSION})


def refusal(frame: bytes) -> str:
    reply = KV_RANKS.decode(answer(KV_RANKS, HANDLERS, frame))
    assert isinstance(reply, Refused), reply
    return reply.reason


def test_a_rank_answers_a_well_formed_command() -> None:
    assert KV_RANKS.decode(answer(KV_RANKS, HANDLERS, encode(Expect("x", (1, 2), 2)))) == Count(2)


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (b"\xc1 not msgpack", "malformed command: undecodable"),
        (raw({"type": "kvr.expec", "xfer_id": "x"}), "unknown message type on the KV ranks"),
        (encode(Abort("r")), "unknown message type on the KV ranks plane"),  # control plane
        (raw({"type": "kvr.expect", "xfer_id": "x", "block_ids": "12", "src_tp": 1}),
         "kvr.expect.block_ids: expected tuple"),
        (raw({"type": "kvr.expect", "xfer_id": "x", "block_ids": [1]}),
         "kvr.expect: missing field 'src_tp'"),
        (raw({"type": "kvr.expect", "xfer_id": "x", "block_ids": [1], "src_tp": 1, "op": 1}),
         "kvr.expect: unknown fields ['op']"),
        (encode(Cancel("x")), "kvr.cancel is no command of the KV ranks plane"),  # no handler
        (encode(Done()), "rank.done is no command of the KV ranks plane"),  # an answer
        (encode(Expect("x", (1,), 9)), "ValueError: no such prefill group"),  # handler raised
    ],
)  # fmt: skip
def test_a_rank_refuses_a_malformed_or_unknown_command_with_the_reason(
    frame: bytes, why: str
) -> None:
    assert why in refusal(frame)


def test_rank_0_raises_a_refusal_naming_the_rank_and_the_command() -> None:
    cmd = Expect("x", (1,), 9)
    with pytest.raises(RankCommandError, match=r"rank 3: kvr.expect failed: ValueError: no su"):
        KV_RANKS.reply(cmd, answer(KV_RANKS, HANDLERS, encode(cmd)), 3)
    with pytest.raises(RankCommandError, match=r"rank 1: kvr.expect failed: answered rank.done"):
        KV_RANKS.reply(cmd, encode(Done()), 1)  # an answer of another command's type
    with pytest.raises(RankCommandError, match="rank 1: kvr.expect failed: this rank has no"):
        KV_RANKS.reply(cmd, answer(None, {}, encode(cmd)), 1)


def test_every_kv_rank_command_has_a_handler_and_every_handler_a_command() -> None:
    handlers = RankKV.handlers(object.__new__(RankKV))  # the table only: no connector
    commands = {c for c in KV_RANKS.types.values() if hasattr(c, "REPLY")}
    assert commands and set(handlers) == commands


# -- nothing else on the path -------------------------------------------------------------------

# The modules between a node and its ranks, both ends.
RANK_PATH = [
    "common/wire/ranks.py",
    "common/engine/tensor_parallel.py",
    "common/engine/tensor_parallel_worker.py",
    "common/engine/model_runner.py",
    "common/node",
    "kv_transfer/ranks.py",
    "kv_transfer/commands.py",
    "prefill_node",
    "decode_node",
    "pdserve/bench/tp.py",
]


def untyped(source: str) -> list[str]:
    """Where `source` sends a command by name (`x.call("name", ...)`), types a payload as
    `list[Any]`, or packs msgpack by hand instead of encoding a message."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            first = node.args[0] if node.args else None
            if node.func.attr == "call" and isinstance(first, ast.Constant):
                found.append(f"{node.lineno}: .call({first.value!r})")
        if isinstance(node, ast.Subscript) and ast.unparse(node) == "list[Any]":
            found.append(f"{node.lineno}: list[Any]")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if "msgpack" in names:
                found.append(f"{node.lineno}: import msgpack")
    return found


def test_the_scan_finds_what_it_looks_for() -> None:
    bad = 'import msgpack\ndef f(kv, x: list[Any]) -> None:\n    kv.call("expect", [x])\n'
    assert sorted(untyped(bad)) == ["1: import msgpack", "2: list[Any]", "3: .call('expect')"]


def test_no_string_named_command_or_untyped_payload_between_a_node_and_its_ranks() -> None:
    files = []
    for name in RANK_PATH:
        path = ROOT / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert len(files) > len(RANK_PATH)  # the folders' modules are all read
    found = {}
    for path in files:
        hits = untyped(path.read_text())
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert found == {}


def test_messages_of_the_rank_planes_are_typed_dataclasses() -> None:
    for cls in KV_RANKS.types.values():
        assert issubclass(cls, Message) and cls.__dataclass_params__.frozen, cls


def imports(path: Path) -> list[tuple[str, bool]]:
    """Each module `path` imports, and whether at its top level (not in a function or an
    `if TYPE_CHECKING:` block)."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
    return found


def test_common_node_never_imports_kv_transfer() -> None:
    files = sorted((ROOT / "common/node").rglob("*.py"))
    assert len(files) > 3
    found = [
        f"{path.name}: {module}"
        for path in files
        for module, _ in imports(path)
        if module.startswith("pdserve.kv_transfer")
    ]
    assert found == []


def test_the_rank_path_imports_everything_at_the_top() -> None:
    """No import put off into a function or behind TYPE_CHECKING: an import cycle shows."""
    files = [
        ROOT / name
        for name in RANK_PATH + ["common/rendezvous.py"]
        if name.endswith(".py") and name != "common/engine/model_runner.py"
    ]
    late = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in files
        for module, at_top in imports(path)
        if not at_top and module.startswith("pdserve")
    }
    assert late == set()


def test_a_step_reaches_a_worker_as_rank_0_scheduled_it() -> None:
    seqs = (
        ScheduledSeq("a", (5, 6, 7), 16, (2, 9), True, SamplingParams(temperature=0.7)),
        ScheduledSeq("b", (8,), 3, (4,), False, SamplingParams(), prompt_targets=(1, 2),
                     prompt_target_pos=3),
    )  # fmt: skip
    ship = ShipKV((Shipment(("tcp://d:1", "tcp://d:2"), "x", (2, 9), (7, 1)),))
    step = STEPS.decode(encode(Step.of(seqs, True, ship)))
    assert isinstance(step, Step) and step.compiled
    assert KV_RANKS.decode(step.hook) == ship
    plain = SamplingParams()  # a worker does not sample
    assert step.scheduled() == tuple(replace(s, request_id="", sampling=plain) for s in seqs)
    assert STEPS.decode(encode(Step.of(seqs, False, None))).hook == b""
