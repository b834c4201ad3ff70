"""An OTLP/HTTP traces receiver in the test process: what an OpenTelemetry collector would receive.

It answers ``POST /v1/traces`` (protobuf ``ExportTraceServiceRequest``, opentelemetry-proto) on a
thread of its own and keeps every span as a ``ReceivedSpan``.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    attributes: dict


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self, port: int = 0):
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Condition()  # notified as each export lands
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        """What ``--otlp-traces-endpoint`` takes: ``host:port``."""
        return f"127.0.0.1:{self.server.server_address[1]}"

    def take(self, req: ExportTraceServiceRequest) -> None:
        got = []
        for rs in req.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                            s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes}))
        with self.lock:
            self.spans.extend(got)
            self.lock.notify_all()

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 60.0) -> list[ReceivedSpan]:
        """The trace's spans once every name in ``names`` is among them (the exporters batch)."""
        def complete() -> bool:
            return names <= {s.name for s in self.spans if s.trace_id == trace_id}

        with self.lock:
            if not self.lock.wait_for(complete, timeout):
                got = [s for s in self.spans if s.trace_id == trace_id]
                raise AssertionError(f"missing {names - {s.name for s in got}}; got {got}")
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":  # a collector stand-in of its own (scripts/bench_router.py --traced)
    import argparse

    p = argparse.ArgumentParser(allow_abbrev=False, description="OTLP/HTTP traces receiver")
    p.add_argument("--port", type=int, required=True)
    OtlpReceiver(p.parse_args().port).thread.join()
