"""The ``trace:`` section: OpenTelemetry spans of every step, phase and sample (``engine.run.tracing``)."""

from __future__ import annotations

from pydantic import Field

from trellis.engine.config.base import Frozen, Location


class TraceConfig(Frozen):
    """Spans per step, per phase and per sample (its generation, each agent turn, its reward), exported
    over OTLP/HTTP to the collector the user names (Jaeger, Tempo, Honeycomb, an OpenTelemetry
    Collector...) and/or written to a file. Needs ``pip install opentelemetry-sdk
    opentelemetry-exporter-otlp-proto-http`` where the run's driver runs."""

    enabled: bool = Field(False, description="Trace the run's steps.")
    endpoint: str | None = Field(
        None, description="OTLP/HTTP traces endpoint, e.g. http://localhost:4318/v1/traces; null: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT when set, else no export.",
    )
    file: Location | None = Field(
        None, description="Also write every span as a JSON line here; default {run}/logs/traces.jsonl when no "
        "endpoint is set or found.",
    )
    samples: bool = Field(True, description="A span per sample's generation, agent turn and reward (under its batch's phase).")
    service_name: str = Field("trellis", min_length=1, description="The service.name resource attribute of every span.")
