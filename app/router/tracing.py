"""Spans of `/v1` requests, exported with OpenTelemetry's SDK over OTLP/HTTP.

Imported only when `LLMGW_OTLP_ENDPOINT` is set (app/gateway/assembly.py): without
it nothing of OpenTelemetry is loaded and the router's only cost is one
`is not None` test per request and per attempt (the optional dependencies:
`pip install llmgw[otel]`). docs/design/logs.md.

Each request is a SERVER span (`POST /v1/chat/completions`), a child of the
client's `traceparent` when it sent one, with the request id, key id, model,
replica and the status the client got; each attempt on a replica is a
CLIENT span under it (a request retried on a second replica shows two),
with the replica and its answer's status or why it failed. The client's
`traceparent` and `tracestate` still reach the engine unchanged (relay.py),
so an engine that traces (vLLM's `--otlp-traces-endpoint`) joins the
client's trace. Spans leave in batches from the SDK's own thread: the event
loop never waits on the collector.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from app.router.access import Exchange

_PROPAGATOR = TraceContextTextMapPropagator()


class OtelTracer:
    """The router's `Tracer` (app/router/access.py) on a TracerProvider:
    a test passes one with an in-memory exporter."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("llmgw.router")

    def begin(self, ex: Exchange) -> None:
        parent = None
        if ex.traceparent is not None:
            carrier = {"traceparent": ex.traceparent.decode("ascii")}
            if ex.tracestate is not None:
                carrier["tracestate"] = ex.tracestate.decode("ascii")
            parent = _PROPAGATOR.extract(carrier)
        ex.span = self._tracer.start_span(
            f"{ex.method} {ex.path}", context=parent, kind=SpanKind.SERVER,
            attributes={"llmgw.request_id": ex.request_id, "http.request.method": ex.method,
                        "url.path": ex.path})

    def end(self, ex: Exchange) -> None:
        span = ex.span
        if ex.key_id is not None:
            span.set_attribute("llmgw.key_id", ex.key_id)
        if ex.model is not None:
            span.set_attribute("gen_ai.request.model", ex.model)
        if ex.replica is not None:
            span.set_attribute("llmgw.replica", ex.replica)
        span.set_attribute("http.response.status_code", ex.status)
        if ex.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def attempt(self, ex: Exchange, replica: str) -> None:
        ex.attempt_span = self._tracer.start_span(
            "attempt", context=trace.set_span_in_context(ex.span), kind=SpanKind.CLIENT,
            attributes={"llmgw.replica": replica})

    def attempt_end(self, ex: Exchange, status: int | None, error: str | None) -> None:
        span = ex.attempt_span
        if span is None:
            return
        ex.attempt_span = None
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def shutdown(self) -> None:
        """Exports what is left (blocks: call it off the event loop)."""
        self.provider.shutdown()


def otlp_tracer(endpoint: str, gateway_id: str) -> OtelTracer:
    """Spans exported to an OTLP/HTTP collector at `endpoint` (its base URL,
    as OTEL_EXPORTER_OTLP_ENDPOINT: `/v1/traces` is added)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    provider = TracerProvider(resource=Resource.create(
        {"service.name": "llmgw", "service.instance.id": gateway_id}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return OtelTracer(provider)
