"""OpenTelemetry traces of requests (``--enable-trace``, SGLang's flag), exported by OTLP/HTTP.

One trace per request: the router, the prefill server and the decode server each add spans under
the W3C ``traceparent`` the hop before them sent (the client's at the router). Spans are made in
the HTTP process, from times it knows and from the stage timeline a scheduler rank returns with a
sampled request's final output (``engine/sched/stage_recorder.py``), so scheduler processes export
nothing.

Off by default; when off nothing here is imported or made (``make_tracer`` returns None and callers
test for None), so the OpenTelemetry packages are needed only with ``--enable-trace``
(``pip install 'pdserve[trace]'``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

TRACE_PACKAGES = "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http (pip install 'pdserve[trace]')"
DEFAULT_ENDPOINT = "localhost:4318"  # an OpenTelemetry collector's OTLP/HTTP port
TRACEPARENT = "traceparent"
# the tracing flags' help, the same on `pdserve serve` and on the router
TRACE_FLAG_HELP = {
    "enable_trace": "export an OpenTelemetry span tree per request (needs pdserve[trace]; docs/DEPLOYMENT.md)",
    "otlp_traces_endpoint": "OTLP/HTTP collector: host:port (path /v1/traces) or a full URL",
    "trace_sample_ratio": "share of requests without a client traceparent that are traced (0..1)",
}


@dataclass(frozen=True)
class TraceConfig:
    """What ``--enable-trace``, ``--otlp-traces-endpoint`` and ``--trace-sample-ratio`` say."""

    enable: bool = False
    endpoint: str = DEFAULT_ENDPOINT
    sample_ratio: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in [0, 1], got {self.sample_ratio}")
        if not self.endpoint:
            raise ValueError("otlp_traces_endpoint must not be empty")

    @property
    def url(self) -> str:
        """The OTLP/HTTP traces URL: ``host:port`` becomes ``http://host:port/v1/traces``."""
        url = self.endpoint if "://" in self.endpoint else "http://" + self.endpoint
        scheme, _, rest = url.partition("://")
        return url if "/" in rest else url + "/v1/traces"


def monotonic_to_ns(t: float) -> int:
    """A ``time.monotonic()`` reading as epoch nanoseconds (what span times are)."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


class Tracer:
    """A tracer provider with its batching OTLP/HTTP exporter, and the few calls pdserve makes."""

    def __init__(self, config: TraceConfig, service_name: str):
        try:
            from opentelemetry import context, propagate, trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        except ImportError as e:
            raise RuntimeError(f"--enable-trace needs {TRACE_PACKAGES}: {e}") from None
        self._context = context
        self._propagate = propagate
        self._trace = trace
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        self.exporter = OTLPSpanExporter(endpoint=config.url)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("pdserve")
        self.server_kind = trace.SpanKind.SERVER
        self.client_kind = trace.SpanKind.CLIENT
        self.internal_kind = trace.SpanKind.INTERNAL

    def extract(self, headers: Mapping[str, str]) -> Any:
        """The context a request's ``traceparent`` header names (an empty one without it)."""
        return self._propagate.extract({TRACEPARENT: headers[TRACEPARENT]} if TRACEPARENT in headers else {})

    def start(self, name: str, parent: Any = None, kind: Any = None, start_ns: int | None = None,
              attributes: dict | None = None) -> Any:
        """A started span under ``parent`` (a context; None: the current one)."""
        return self.tracer.start_span(name, context=parent, kind=kind or self.internal_kind,
                                      start_time=start_ns, attributes=attributes)

    def sampled(self, ctx: Any) -> bool:
        """Whether the span current in ``ctx`` records (the sampler kept its trace)."""
        return self._trace.get_current_span(ctx).is_recording()

    def context_of(self, span: Any, parent: Any = None) -> Any:
        return self._trace.set_span_in_context(span, parent)

    def attach(self, ctx: Any) -> Any:
        return self._context.attach(ctx)

    def detach(self, token: Any) -> None:
        self._context.detach(token)

    def current(self) -> Any:
        return self._context.get_current()

    def headers(self, ctx: Any) -> dict[str, str]:
        """The ``traceparent`` header that continues ``ctx`` on the next hop."""
        out: dict[str, str] = {}
        self._propagate.inject(out, context=ctx)
        return out

    def add_counts(self, ctx: Any, counts: Mapping[str, int]) -> None:
        """Add ``counts`` to the integer attributes of the span current in ``ctx`` (a request's
        sequences each add theirs to its one server span); nothing when that span does not record."""
        span = self._trace.get_current_span(ctx)
        if span.is_recording():
            have = getattr(span, "attributes", None) or {}
            span.set_attributes({k: have.get(k, 0) + v for k, v in counts.items()})

    def record(self, name: str, parent: Any, start_ns: int, end_ns: int, attributes: dict | None = None) -> None:
        """A finished span from two times already measured."""
        self.tracer.start_span(name, context=parent, start_time=start_ns,
                               attributes=attributes).end(end_time=max(start_ns, end_ns))

    def shutdown(self) -> None:
        """Export what is batched and stop the exporter."""
        self.provider.shutdown()


def make_tracer(config: TraceConfig, service_name: str) -> Tracer | None:
    """The tracer of ``--enable-trace``; None when tracing is off (nothing is imported or created)."""
    return Tracer(config, service_name) if config.enable else None
