"""common/tracing.py: off costs no import of the SDK; the flags are checked; a missing SDK is
named; the request context continues a parent's trace and follows its sampling."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.common.tracing import Tracer, TracingConfig, tracer_of
from pdserve.router.cluster.timing import valid_traceparent

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
NOWHERE = "http://127.0.0.1:9/v1/traces"  # nothing is exported in these tests


def test_tracing_is_off_unless_an_endpoint_is_given() -> None:
    assert tracer_of("router", TracingConfig()) is None
    assert tracer_of("router", TracingConfig(trace_sample_ratio=0.5)) is None


@pytest.mark.parametrize(
    "settings,why",
    [
        ({"trace_sample_ratio": 1.5}, "sample ratio"),
        ({"trace_sample_ratio": -0.1}, "sample ratio"),
        ({"otlp_traces_endpoint": "127.0.0.1:4318"}, "http"),
    ],
)
def test_bad_tracing_flags_are_refused_by_name(settings: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        TracingConfig(**settings)


def test_without_the_flag_no_process_imports_the_sdk() -> None:
    """Every role's modules and a request's router-side trace, with tracing off: nothing of
    the OpenTelemetry SDK or exporter is imported (a fresh interpreter)."""
    code = """
import sys
import pdserve.prefill_node.node, pdserve.decode_node.node, pdserve.router.__main__
import pdserve.common.engine.tensor_parallel_worker
from pdserve.common.node.stages import StageClock
from pdserve.common.tracing import TracingConfig, tracer_of
from pdserve.router.backend import GenerateRequest
from pdserve.router.cluster.timing import RequestTrace
from pdserve.common.wire.payloads import SamplingParams
tracer = tracer_of("router", TracingConfig())
trace = RequestTrace(tracer, GenerateRequest("r", (1,), SamplingParams()), "m")
assert trace.traceparent is None and not trace.on
StageClock(tracer, "n").taken("r", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")
loaded = [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_missing_sdk_is_named_with_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails
    with pytest.raises(RuntimeError, match=r"pdserve\[tracing\]"):
        tracer_of("router", TracingConfig(otlp_traces_endpoint=NOWHERE))


@pytest.mark.parametrize(
    "header,valid",
    [
        (PARENT, True),
        (PARENT.upper(), True),  # taken lower-cased
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", False),  # no flags
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", False),  # the invalid all-zero trace id
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),  # version ff
        ("00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01", False),  # not hex
        (None, False),
    ],
)
def test_an_incoming_traceparent_is_taken_only_when_well_formed(header, valid) -> None:
    assert (valid_traceparent(header) is not None) is valid
    if valid:
        assert valid_traceparent(header) == PARENT


def test_a_request_span_continues_its_parent_and_follows_its_sampling() -> None:
    tracer = Tracer("router", NOWHERE, ratio=0.0)  # starts no trace of its own
    try:
        assert not any(tracer.sampled(None) for _ in range(100)), "a root at ratio 0"
        assert tracer.sampled(PARENT), "the parent sampled it"
        child = tracer.start("llm_request", PARENT, 0.0, {})
        continued = tracer.traceparent(child)
        assert continued is not None
        version, trace_id, span_id, flags = continued.split("-")
        assert (version, trace_id, flags) == ("00", PARENT.split("-")[1], "01")
        assert span_id != PARENT.split("-")[2]
        unsampled = PARENT[:-2] + "00"
        assert not tracer.sampled(unsampled)
        assert tracer.traceparent(tracer.start("llm_request", unsampled, 0.0, {})) is None
    finally:
        tracer.close()  # no span ended: nothing to export


def test_the_ratio_is_drawn_once_per_root_before_any_span() -> None:
    tracer = Tracer("router", NOWHERE, ratio=0.1)
    try:
        kept = sum(tracer.sampled(None) for _ in range(20_000))
        assert 1_600 < kept < 2_400, kept  # 10% of 20,000 roots, +-9 standard deviations
        every = Tracer("router", NOWHERE, ratio=1.0)
        assert all(every.sampled(None) for _ in range(1_000))
        # A root the ratio kept is recorded whole: the SDK does not draw a second time.
        assert every.traceparent(every.start("llm_request", None, 0.0, {})) is not None
        every.close()
    finally:
        tracer.close()
