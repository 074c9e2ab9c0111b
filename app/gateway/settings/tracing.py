"""Tracing (and, when it comes, logging): what the gateway tells an
operator's collectors. Read by the gateway when it starts
(app/router/tracing.py)."""

from __future__ import annotations

from app.gateway.settings._group import Group


class TracingSettings(Group):
    # Base URL of an OTLP/HTTP collector (e.g. http://otel-collector:4318):
    # a span per /v1 request and per attempt is exported there (needs the
    # `otel` extra). Empty: no tracing, and OpenTelemetry is not even
    # imported. Set, it costs some 20-40 us of CPU per request (the spans;
    # export runs in the SDK's thread, in batches) and the collector's load.
    otlp_endpoint: str = ""
