"""``--enable-trace`` and its flags, without servers: off makes nothing, on without the packages
is a clear error, the flags are checked, the endpoint becomes the OTLP/HTTP URL."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.otlp_receiver import OtlpReceiver

from pdserve.engine.tracing import TRACE_PACKAGES, TraceConfig, Tracer, make_tracer
from pdserve.router.config import RouterConfig
from pdserve.router.server import Router


def test_tracing_off_creates_no_exporter_and_imports_no_sdk():
    """Off (the default): no tracer, no provider, no exporter; pdserve imports no OpenTelemetry SDK."""
    assert make_tracer(TraceConfig(), "pdserve-router") is None
    assert Router(RouterConfig()).tracer is None
    code = ("import sys; import pdserve.router.server, pdserve.engine.frontend.http_server, pdserve.entrypoints.serve; "
            "from pdserve.router.server import Router; from pdserve.router.config import RouterConfig; "
            "assert Router(RouterConfig()).tracer is None; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tracing_on_makes_one_provider_with_the_otlp_http_exporter():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    tracer = make_tracer(TraceConfig(True, "127.0.0.1:9", 0.5), "pdserve-test")
    try:
        assert isinstance(tracer, Tracer) and isinstance(tracer.exporter, OTLPSpanExporter)
    finally:
        tracer.shutdown()


def test_enable_trace_without_the_packages_names_them(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(RuntimeError, match="opentelemetry-sdk") as e:
        make_tracer(TraceConfig(enable=True), "pdserve-test")
    assert TRACE_PACKAGES in str(e.value)


@pytest.mark.parametrize("endpoint, url", [
    ("localhost:4318", "http://localhost:4318/v1/traces"),
    ("http://collector:4318", "http://collector:4318/v1/traces"),
    ("https://otel.example/custom/path", "https://otel.example/custom/path"),
])
def test_endpoint_becomes_the_traces_url(endpoint, url):
    assert TraceConfig(True, endpoint).url == url


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_sample_ratio_out_of_range_is_refused_naming_the_flag(ratio):
    with pytest.raises(ValueError, match="trace_sample_ratio"):
        RouterConfig(enable_trace=True, trace_sample_ratio=ratio)


def test_the_flags_of_the_router_and_of_serve():
    from pdserve.entrypoints.flags import parse_serve_args
    from pdserve.router.cli import build_parser, config_from_args

    flags = ["--enable-trace", "--otlp-traces-endpoint", "collector:4318", "--trace-sample-ratio", "0.25"]
    router = config_from_args(build_parser().parse_args(["--decode", "http://d:1", *flags]))
    serve = parse_serve_args(flags)
    for c in (router, serve):
        assert (c.enable_trace, c.otlp_traces_endpoint, c.trace_sample_ratio) == (True, "collector:4318", 0.25)
    assert not config_from_args(build_parser().parse_args([])).enable_trace
    assert not parse_serve_args([]).enable_trace


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_a_router_error_passes_through_the_routers_spans(on):
    """The router's errors are frozen dataclasses: a span's block must not write to them."""
    from pdserve.router.errors import RouterError
    from pdserve.router.trace_spans import child_span, request_span

    receiver = OtlpReceiver()  # a collector that answers, so that shutdown's export does not retry
    tracer = make_tracer(TraceConfig(on, receiver.endpoint), "pdserve-test")
    try:
        with pytest.raises(RouterError):
            with child_span(tracer, "router.queue"):
                raise RouterError(429, "full", "rate_limit_error")
        if tracer is not None:
            with pytest.raises(RouterError):
                with request_span(tracer, {}, "/generate"):
                    raise RouterError(503, "none", "service_unavailable")
    finally:
        if tracer is not None:
            tracer.shutdown()
        receiver.close()
    assert {s.name for s in receiver.spans} == ({"router.queue", "router.request"} if on else set())
