"""Request spans (app/router/tracing.py), seen with OpenTelemetry's in-memory
exporter: the client's traceparent as the parent, the request's attributes,
one child span per attempt."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from app.router.tracing import OtelTracer
from tests.support.procs import ROOT
from tests.support.proxy_rig import CHAT, CLIENT_KEY, MESSAGES, Rig

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
async def traced() -> AsyncIterator[tuple[Rig, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rig = Rig(tracer=OtelTracer(provider))
    await rig.proxy.start()
    try:
        yield rig, exporter
    finally:
        await rig.close()
        provider.shutdown()


async def test_a_retried_request_is_a_child_of_the_clients_trace_with_two_attempts(
        traced: tuple[Rig, InMemorySpanExporter]) -> None:
    rig, exporter = traced
    bad, good = await rig.upstream("a", "503"), await rig.upstream("b")
    rig.route("small", ("a", bad.url), ("b", good.url))  # MESSAGES hash to "a": tried first
    r = await rig.http.post(CHAT, json={"model": "small", "messages": MESSAGES}, headers={
        "Authorization": f"Bearer {CLIENT_KEY}", "traceparent": TRACEPARENT,
        "tracestate": "rojo=00f067aa0ba902b7", "X-Request-Id": "traced-1"})
    assert r.status_code == 200
    for up in (bad, good):  # the client's trace context reaches each attempt unchanged
        sent = {k.lower(): v for k, v in up.seen[0][0].items()}
        assert sent["traceparent"] == TRACEPARENT
        assert sent["tracestate"] == "rojo=00f067aa0ba902b7"

    spans = exporter.get_finished_spans()
    (request,) = [s for s in spans if s.kind is SpanKind.SERVER]
    attempts = sorted((s for s in spans if s.kind is SpanKind.CLIENT),
                      key=lambda s: s.start_time or 0)
    assert request.name == "POST /v1/chat/completions"
    assert request.parent is not None and request.parent.is_remote
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert format(request.parent.span_id, "016x") == PARENT_ID
    attrs = dict(request.attributes or {})
    assert attrs["gen_ai.request.model"] == "small" and attrs["llmgw.replica"] == "b"
    assert attrs["http.response.status_code"] == 200 and attrs["llmgw.request_id"] == "traced-1"
    assert attrs["llmgw.key_id"] == "k1"

    assert [dict(a.attributes or {})["llmgw.replica"] for a in attempts] == ["a", "b"]
    for a in attempts:
        assert a.parent is not None and a.parent.span_id == request.context.span_id
        assert a.context.trace_id == request.context.trace_id
    assert dict(attempts[0].attributes or {})["http.response.status_code"] == 503
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert dict(attempts[1].attributes or {})["http.response.status_code"] == 200


async def test_without_a_traceparent_the_request_starts_its_own_trace(
        traced: tuple[Rig, InMemorySpanExporter]) -> None:
    rig, exporter = traced
    r = await rig.chat("small")  # no replica: 503, still a span
    assert r.status_code == 503
    (span,) = exporter.get_finished_spans()
    assert span.parent is None
    assert dict(span.attributes or {})["http.response.status_code"] == 503
    assert span.status.status_code is StatusCode.ERROR


def test_a_gateway_without_an_endpoint_never_imports_the_sdk() -> None:
    # (FastAPI itself imports opentelemetry's API; the SDK, the exporter and
    # our tracing module stay out.)
    code = ("import sys; from app.gateway.main import create_app; "
            "from app.gateway.settings import Settings; "
            "import tempfile; create_app(Settings(data_dir=tempfile.mkdtemp())); "
            "print(sorted(m for m in sys.modules if m.startswith(("
            "'opentelemetry.sdk', 'opentelemetry.exporter', 'app.router.tracing'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
