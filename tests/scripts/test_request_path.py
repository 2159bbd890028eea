"""scripts/request_path.py: what counts as the request's files, folders and zigzags, on small
made-up traces; and its tracer, in a child process over two made-up source files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "request_path.py"


@pytest.fixture(scope="module")
def rp():
    spec = importlib.util.spec_from_file_location("request_path", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["request_path"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["request_path"]


def fn(path: str, name: str = "f") -> tuple[str, int, str]:
    return (path, 1, name)


def call(rp, caller: str | None, callee: str, first: int, last: int | None = None):
    """A call from caller's function f (None: a root) to callee's f, at `first`."""
    return rp.Call(caller and fn(caller), fn(callee), first, first if last is None else last)


def test_folder_is_the_directory(rp) -> None:
    assert rp.folder_of("router/cluster/routing.py") == "router/cluster"
    assert rp.folder_of("router/app.py") == "router"
    assert rp.folder_of("setup.py") == "."


def test_functions_that_also_ran_idle_and_files_outside_the_source_drop_out(rp) -> None:
    windows = {
        "request": [
            call(rp, None, "common/node/loop.py", 1),  # the loop's poll, idle too
            call(rp, None, "prefill_node/node.py", 2),
            call(rp, None, "tests/helper.py", 3),  # not source
        ],
        "idle-before": [call(rp, None, "common/node/loop.py", 0)],
        "idle-after": [],
    }
    source = {"common/node/loop.py", "prefill_node/node.py"}
    kept = rp.request_calls(windows, source)
    assert [c.path for c in kept] == ["prefill_node/node.py"]


def test_a_function_idle_in_the_window_after_only_drops_out_too(rp) -> None:
    windows = {
        "request": [call(rp, None, "a/x.py", 1), call(rp, None, "b/y.py", 2)],
        "idle-before": [],
        "idle-after": [call(rp, None, "b/y.py", 9)],
    }
    assert [c.path for c in rp.request_calls(windows, {"a/x.py", "b/y.py"})] == ["a/x.py"]


def test_files_in_the_order_of_their_first_call(rp) -> None:
    calls = [
        call(rp, None, "b/y.py", 5),
        rp.Call(None, fn("a/x.py", "g"), 7, 7),
        call(rp, None, "a/x.py", 3),
        call(rp, None, "c/z.py", 4),
    ]
    assert rp.first_touches(calls) == ["a/x.py", "c/z.py", "b/y.py"]


def edges(rp, *pairs: tuple[str, str]) -> list:
    """Calls between the first file of each folder pair, in the given order."""
    return [call(rp, f"{a}/m.py", f"{b}/m.py", i) for i, (a, b) in enumerate(pairs)]


def test_calls_down_the_layers_are_no_zigzag(rp) -> None:
    down = edges(rp, ("router", "router/cluster"), ("router/cluster", "common/wire"))
    down += edges(rp, ("router", "common/engine"))
    assert rp.zigzags("router", down) == []


def test_a_call_back_up_is_one_zigzag(rp) -> None:
    found = rp.zigzags(
        "router", edges(rp, ("router", "router/cluster"), ("router/cluster", "router"))
    )
    assert [(z.process, z.folders, z.count) for z in found] == [
        ("router", ("router", "router/cluster"), 1)
    ]
    assert found[0].calls == (
        (fn("router/m.py"), fn("router/cluster/m.py")),
        (fn("router/cluster/m.py"), fn("router/m.py")),
    )


def test_the_same_folder_pair_called_again_counts_once(rp) -> None:
    found = rp.zigzags("p", edges(rp, ("a", "b"), ("b", "a"), ("a", "b"), ("b", "a")))
    assert sum(z.count for z in found) == 1
    assert len(found[0].calls) == 2  # the first call per folder edge


def test_a_cycle_through_three_folders_is_one_zigzag(rp) -> None:
    found = rp.zigzags("p", edges(rp, ("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")))
    assert [(z.folders, z.count) for z in found] == [(("a", "b", "c"), 1)]


def test_independent_cycles_add_up(rp) -> None:
    # engine -> node hook -> kv and back into the engine, and the node calls the engine too
    pairs = [("node", "engine"), ("engine", "node"), ("node", "kv"), ("kv", "engine")]
    separate = [("router", "router/cluster"), ("router/cluster", "router")]
    found = rp.zigzags("p", edges(rp, *pairs, *separate))
    assert [(z.folders, z.count) for z in found] == [
        (("engine", "kv", "node"), 2),
        (("router", "router/cluster"), 1),
    ]


def test_only_new_calls_between_folders_of_the_source_are_edges(rp) -> None:
    windows = {
        "request": [
            call(rp, "a/x.py", "a/y.py", 1),  # same folder
            call(rp, None, "b/z.py", 2),  # a root
            call(rp, "a/x.py", "b/z.py", 3),  # idle too
            call(rp, "b/z.py", "a/x.py", 4),  # kept
            call(rp, "b/z.py", "tests/t.py", 5),  # not source
        ],
        "idle-before": [call(rp, "a/x.py", "b/z.py", 0)],
        "idle-after": [],
    }
    kept = rp.request_edges(windows, {"a/x.py", "a/y.py", "b/z.py"})
    assert [(c.caller[0], c.path) for c in kept] == [("b/z.py", "a/x.py")]


def test_returns_along_a_first_touch_order(rp) -> None:
    order = ["r/a.py", "r/b.py", "c/x.py", "r/d.py", "c/y.py", "e/z.py"]
    assert rp.returns(order) == [("c/x.py", "r/d.py"), ("r/d.py", "c/y.py")]
    assert rp.returns(["r/a.py", "c/x.py", "e/z.py"]) == []


def test_the_path_runs_router_nodes_router(rp) -> None:
    calls = {
        "router": [
            call(rp, None, "router/handlers.py", 1, 50),
            call(rp, None, "router/cluster/control.py", 3, 40),
            call(rp, None, "router/admission.py", 2, 2),
            call(rp, None, "router/streaming.py", 30, 45),
        ],
        "prefill0": [call(rp, None, "prefill_node/node.py", 10)],
        "decode0": [call(rp, None, "decode_node/node.py", 5)],
    }
    assert rp.path_segments(calls) == [
        (
            "router, before the nodes",
            ["router/handlers.py", "router/admission.py", "router/cluster/control.py"],
        ),
        ("prefill0", ["prefill_node/node.py"]),
        ("decode0", ["decode_node/node.py"]),
        (
            "router, after the nodes' first call",
            ["router/handlers.py", "router/cluster/control.py", "router/streaming.py"],
        ),
    ]


def test_summary_counts_each_file_once_across_processes(rp) -> None:
    def windows(*request) -> dict:
        return {"request": list(request), "idle-before": [], "idle-after": []}

    router = windows(
        call(rp, None, "router/handlers.py", 1),
        call(rp, "router/handlers.py", "router/cluster/backend.py", 2),
        call(rp, "router/cluster/backend.py", "router/backend.py", 3),
        call(rp, "router/cluster/backend.py", "common/wire/messages.py", 4),
    )
    node = windows(
        call(rp, None, "common/wire/messages.py", 10),
        call(rp, "common/wire/messages.py", "common/engine/sampling_params.py", 11),
    )
    source = {c.path for w in (router, node) for c in w["request"]}
    summary = rp.summarize({"router": router, "decode0": node}, source)
    assert summary["per_process"] == {"router": 4, "decode0": 2}
    assert len(summary["files"]) == 5
    assert summary["folders"] == ["common/engine", "common/wire", "router", "router/cluster"]
    assert summary["zigzags"] == 1
    assert [c["folders"] for c in summary["cycles"]] == [("router", "router/cluster")]
    text = rp.render(summary, "head")
    assert "files: 5 (router 4, decode0 2" in text and "zigzags: 1" in text


def test_lines_per_folder_count_tracked_python_outside_tests(rp, tmp_path: Path) -> None:
    files = {"a/x.py": "1\n2\n", "a/b/y.py": "1\n", "tests/t.py": "1\n", "a/notes.md": "1\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "untracked.py").write_text("1\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=60)
    subprocess.run(["git", "-C", str(tmp_path), "add", *files], check=True, timeout=60)
    assert rp.lines_per_folder(tmp_path) == {"a": 2, "a/b": 1}


def test_the_tracer_records_calls_of_source_functions_with_their_caller(rp, tmp_path) -> None:
    code = tmp_path / "code"
    (code / "low").mkdir(parents=True)
    (code / "top.py").write_text("import low.mod\n\ndef f():\n    return low.mod.g()\n")
    (code / "low" / "mod.py").write_text("import json\n\ndef g():\n    return json.dumps(1)\n")
    main = "import sys, top\nfor line in sys.stdin:\n    top.f()\n    print('ok', flush=True)\n"
    work = tmp_path / "work"
    work.mkdir()
    (work / "sources").write_text(f"{code.resolve() / 'top.py'}\n{code.resolve() / 'low/mod.py'}\n")
    env = {**os.environ, **rp.child_env(rp.REPO, work)}
    env["PYTHONPATH"] += os.pathsep + str(code)
    child = subprocess.Popen(
        [sys.executable, "-c", main], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        rp.open_window(work, "request", [child.pid])
        child.stdin.write(b"go\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"ok\n"
        rp.open_window(work, "", [child.pid])
    finally:
        child.kill()
        child.wait(timeout=30)
    body = json.loads((work / "out" / f"{child.pid}.request.json").read_text())
    calls = {(c and c[2], f[2]) for c, f, *_ in body["calls"]}
    assert calls == {(None, "f"), ("f", "g")}  # json's functions are no source
