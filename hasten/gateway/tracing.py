"""Optional OpenTelemetry tracing. Off by default; a no-op when disabled or not installed.

With ``tracing.enabled: true`` each proxied request gets a ``gateway.request`` span and a
W3C ``traceparent`` header is injected into the upstream request. Exporters need the
``opentelemetry-sdk`` package (``console``) and ``opentelemetry-exporter-otlp`` (``otlp``);
when they are missing the gateway logs a warning and keeps running without export.
"""

from __future__ import annotations

import logging
from typing import Any

from hasten.gateway.config import TracingConfig

log = logging.getLogger("hasten.gateway")


class NoopSpan:
    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def end(self) -> None:
        return None


NOOP_SPAN = NoopSpan()


class Tracer:
    def __init__(self, cfg: TracingConfig) -> None:
        self.enabled = False
        self._tracer: Any = None
        self._propagate: Any = None
        if not cfg.enabled:
            return
        try:
            from opentelemetry import propagate, trace
        except ImportError:
            log.warning("tracing enabled but opentelemetry is not installed; tracing is a no-op")
            return
        if cfg.exporter != "none":
            _install_exporter(cfg)
        self._tracer = trace.get_tracer("hasten.gateway")
        self._propagate = propagate
        self.enabled = True

    def start(self, name: str, attributes: dict[str, Any]) -> Any:
        if not self.enabled:
            return NOOP_SPAN
        return self._tracer.start_span(name, attributes=attributes)

    def inject(self, span: Any, headers: dict[str, str]) -> None:
        if not self.enabled or span is NOOP_SPAN:
            return
        from opentelemetry import trace

        self._propagate.inject(headers, context=trace.set_span_in_context(span))


def _install_exporter(cfg: TracingConfig) -> None:
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning("tracing.exporter=%s needs opentelemetry-sdk; spans are not exported", cfg.exporter)
        return
    exporter: Any
    if cfg.exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("tracing.exporter=otlp needs opentelemetry-exporter-otlp; spans are not exported")
            return
        exporter = OTLPSpanExporter(endpoint=cfg.endpoint) if cfg.endpoint else OTLPSpanExporter()
    else:
        exporter = ConsoleSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
