"""`pdserve bench tracing`'s pure parts: each setting's flags, and the summary's medians and
ratios against tracing off, in tokens/s and in CPU per request (the deployments themselves are
the benchmark's run)."""

from __future__ import annotations

from pdserve.bench.tracing import SETTINGS, summary, tracing_flags

URL = "http://127.0.0.1:4318/v1/traces"


def test_off_imports_nothing_and_a_sample_is_the_routers_alone() -> None:
    assert tracing_flags(None, URL) == ([], [])
    router, nodes = tracing_flags(0.1, URL)
    assert router == ["--otlp-traces-endpoint", URL, "--trace-sample-ratio", "0.1"]
    assert nodes == ["--otlp-traces-endpoint", URL]  # a node follows its parent's sampling
    assert SETTINGS["off"] is None and SETTINGS["sample 10%"] == 0.1


def test_each_setting_is_its_median_over_rounds_against_offs_median() -> None:
    speeds = {
        "off": [100.0, 90.0, 110.0],
        "sample 10%": [99.0, 97.0, 50.0],
        "every request": [80.0] * 3,
    }
    cpu = {"off": 10.0, "sample 10%": 10.1, "every request": 12.0}  # ms per request
    rounds = [
        {
            "round": r,
            "setting": name,
            "tokens_per_s": v,
            "cpu_ms_per_request": {"router": cpu[name] / 2 + r, "prefill0": cpu[name] / 2 - r},
        }
        for name, values in speeds.items()
        for r, v in enumerate(values)
    ]
    got = {s["setting"]: s for s in summary(rounds)}
    assert got["off"]["median_tokens_per_s"] == 100.0 and got["off"]["ratio_to_off"] == 1.0
    assert got["sample 10%"]["ratio_to_off"] == 0.97  # the median, not the mean (82)
    assert got["every request"]["ratio_to_off"] == 0.8
    assert got["sample 10%"]["per_round"] == [99.0, 97.0, 50.0]
    # CPU per request: the processes summed per round, the median over rounds, against off's.
    assert got["off"]["median_cpu_ms_per_request"] == 10.0
    assert got["sample 10%"]["cpu_ratio_to_off"] == 1.01
    assert got["every request"]["cpu_ratio_to_off"] == 1.2
    assert got["every request"]["cpu_ms_by_process"] == {"router": 7.0, "prefill0": 5.0}
