"""OpenTelemetry traces of a run (``trace:``): a trace per step, a span per phase under it, and under the
phase that brought the batch a span per sample's generation, agent turn and reward.

Spans are made where the step is driven (the flow's process, or the in-process runner): phases as they
run, samples afterwards from the times the workers recorded on them (``RolloutSample.timings``, carried
back in ``BatchHandle.sample_spans``), so no worker needs a tracer. In the asynchronous trainer a
batch's samples were generated before the ``get_batch`` that took them: their spans start earlier than
their parent. The runner adds its own ids: in a Prefect flow (``tasks.phases``), each step span carries
its flow run's id and each phase span its task run's (``prefect.flow_run_id``, ``prefect.task_run_id``),
and the step's flow run logs its trace id, so a user goes from one to the other. Exported over OTLP/HTTP (``trace.endpoint``) and/or as JSON lines.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

from trellis.engine.errors import SettingError

if TYPE_CHECKING:
    from trellis.engine.config import TrellisConfig
    from trellis.engine.data.samples import RolloutSample

log = logging.getLogger(__name__)
_TRACERS: dict[str, RunTracer] = {}
_LOCK = threading.Lock()


def sample_spans(groups: list[list[RolloutSample]]) -> tuple[tuple[str, str, float, float, dict], ...]:
    """What ``BatchHandle.sample_spans`` carries: each sample's recorded timings, with its rollout id (a
    session's start is only where its first turn begins, no span of its own)."""
    return tuple((s.rollout_id, what, start, end, attrs) for group in groups for s in group
                 for what, start, end, attrs in s.timings if what != "agent.session")


def tracer_for(config: TrellisConfig) -> RunTracer | None:
    """The run's tracer in this process (one per run, kept across its steps' flow runs); None when off."""
    if not config.trace.enabled:
        return None
    with _LOCK:
        if config.run_uri not in _TRACERS:
            _TRACERS[config.run_uri] = RunTracer(config)
        return _TRACERS[config.run_uri]


def close_tracer(config: TrellisConfig) -> None:
    """Send what is left and stop exporting (the run's end)."""
    with _LOCK:
        tracer = _TRACERS.pop(config.run_uri, None)
    if tracer is not None:
        tracer.close()


def step_span(config: TrellisConfig, step: int, attributes: dict[str, str] | None = None,
              announce: Callable[[str, int], None] | None = None) -> ContextManager[Any]:
    """The step's span (nothing when not tracing); ``attributes`` from the runner (a Prefect flow run's
    id), and ``announce(trace_id, step)`` told the trace's id as the step starts."""
    tracer = tracer_for(config)
    return tracer.step(step, attributes or {}, announce) if tracer is not None else nullcontext()


def mark_task_run(task_run_id: str, task_run_name: str) -> None:
    """A phase's Prefect task run on the phase's span, which is current where the flow's runner called
    the task (nothing when not tracing)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({"prefect.task_run_id": task_run_id, "prefect.task_run_name": task_run_name})


class RunTracer:
    def __init__(self, config: TrellisConfig) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError as error:
            raise SettingError(
                f"trace.enabled needs OpenTelemetry where the run is driven ({error}): "
                "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
            ) from error
        settings = config.trace
        resource = Resource.create({"service.name": settings.service_name, "trellis.experiment": config.experiment_name,
                                    "trellis.run_uri": config.run_uri})
        self._provider = TracerProvider(resource=resource)
        self.endpoint = endpoint_of(settings.endpoint)
        if self.endpoint is not None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint)))
        self.file = settings.file or (None if self.endpoint else f"{config.run_uri}/logs/traces.jsonl")
        if self.file is not None and "://" in self.file:
            raise SettingError(f"trace: spans are written to local files only, not {self.file}; set trace.endpoint "
                               "(an OTLP collector) or a local trace.file")
        if self.file is not None:
            self._provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(self.file)))
        self._tracer = self._provider.get_tracer("trellis")

    @contextmanager
    def step(self, step: int, attributes: dict[str, str], announce: Callable[[str, int], None] | None) -> Iterator[Any]:
        try:
            with self._tracer.start_as_current_span(f"step {step}", attributes={"trellis.step": step, **attributes}) as span:
                if announce is not None:
                    announce(f"{span.get_span_context().trace_id:032x}", step)
                yield span
        finally:
            self._provider.force_flush()

    def phase(self, name: str, step: int) -> ContextManager[Any]:
        return self._tracer.start_as_current_span(name, attributes={"trellis.step": step, "trellis.phase": name})

    def samples(self, spans: tuple[tuple[str, str, float, float, dict], ...]) -> None:
        """A span per recorded timing, under the current span (the phase that brought the batch)."""
        for rollout_id, what, start, end, attrs in spans:
            attributes = {"trellis.rollout_id": rollout_id, **{k: v for k, v in attrs.items() if v is not None}}
            span = self._tracer.start_span(f"sample.{what}", start_time=int(start * 1e9), attributes=attributes)
            span.end(end_time=int(max(end, start) * 1e9))

    def close(self) -> None:
        self._provider.shutdown()


def endpoint_of(configured: str | None) -> str | None:
    """The OTLP/HTTP traces endpoint: the config's, else OpenTelemetry's own environment variables."""
    if configured:
        return configured
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    return None


class JsonLinesExporter:
    """Every span as one JSON object per line, appended to a local file."""

    def __init__(self, path: str) -> None:
        self._path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with open(self._path, "a") as handle:
            for span in spans:
                handle.write(json.dumps(json.loads(span.to_json())) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing held open between exports."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
