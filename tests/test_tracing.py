"""OpenTelemetry tracing (``trace:``): spans per step, phase and sample, sent over OTLP/HTTP to a real
receiver started here (it decodes the protobuf requests as a collector does), and written as JSON lines."""

from __future__ import annotations

import gzip
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import run_local as run, tiny_config

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

pytestmark = pytest.mark.slow


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on loopback: every span it is sent, decoded, with its resource."""

    def __init__(self) -> None:
        received = self.spans = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope in resource_spans.scope_spans:
                        received.extend((resource, span) for span in scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()


@pytest.fixture
def receiver():
    server = OtlpReceiver()
    yield server
    server.close()


def _attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        value = a.value
        out[a.key] = value.string_value or value.int_value or value.double_value or value.bool_value
    return out


def test_a_traced_run_sends_a_trace_per_step_with_its_phases_and_samples(tiny_model, reverse_data, tmp_path, receiver):
    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="traced", total_train_steps=2,
                         evaluate_step=2, checkpoint_interval=-1, trace={"enabled": True, "endpoint": receiver.endpoint,
                                                                           "file": str(tmp_path / "spans.jsonl")})
    run(config)
    spans = [span for _, span in receiver.spans]
    assert {resource["service.name"] for resource, _ in receiver.spans} == {"trellis"}
    assert {resource["trellis.run_uri"] for resource, _ in receiver.spans} == {config.run_uri}

    steps = {_attributes(s)["trellis.step"]: s for s in spans if s.name.startswith("step ")}
    assert sorted(steps) == [1, 2]
    assert steps[1].trace_id != steps[2].trace_id and all(not s.parent_span_id for s in steps.values())
    for step_span in steps.values():
        in_trace = [s for s in spans if s.trace_id == step_span.trace_id]
        phases = {s.name: s for s in in_trace if s.parent_span_id == step_span.span_id}
        assert {"produce_batch", "prepare_data", "fit", "sync_weights", "log_step"} <= set(phases)
        for phase in phases.values():
            assert step_span.start_time_unix_nano <= phase.start_time_unix_nano <= phase.end_time_unix_nano <= step_span.end_time_unix_nano
        samples = [s for s in in_trace if s.parent_span_id == phases["produce_batch"].span_id]
        assert Counter(s.name for s in samples) == {"sample.generate": 16 * 8, "sample.reward": 16 * 8}
        assert len({_attributes(s)["trellis.rollout_id"] for s in samples}) == 16 * 8
        for sample in samples:
            assert sample.start_time_unix_nano <= sample.end_time_unix_nano
    assert "evaluate" in {s.name for s in spans if s.trace_id == steps[2].trace_id}

    lines = [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text().splitlines()]
    assert len(lines) == len(spans)  # the same spans, also written as JSON lines
    assert {line["name"] for line in lines} == {s.name for s in spans}


def test_a_remote_trace_file_is_refused_with_the_setting_named(tiny_model, reverse_data, tmp_path):
    """Tried: trace.file on object storage. The run stops at its first step with the setting named."""
    from trellis.engine.errors import SettingError

    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="remote_file", total_train_steps=1,
                         checkpoint_interval=-1, trace={"enabled": True, "file": "s3://bucket/spans.jsonl"})
    with pytest.raises(SettingError, match="spans are written to local files only, not s3://bucket/spans.jsonl"):
        run(config)


def test_an_agent_sessions_turns_are_timed_one_after_another():
    from trellis.engine.data.samples import RolloutSample
    from trellis.engine.rollout.agents.base import append_turn, start_session
    from trellis.engine.run.tracing import sample_spans

    sample = RolloutSample("r0", "g0", "r0", 0, [{"role": "user", "content": "q"}], [1, 2], None, "d", "t")
    start_session(sample, "tool")
    append_turn(sample, [5, 6], [-0.1, -0.2], 1, 0, {"role": "assistant"})
    append_turn(sample, [7], [0.0], 0, 0, {"role": "tool"})
    spans = sample_spans([[sample]])
    assert [(rollout_id, what, attrs["role"], attrs["tokens"]) for rollout_id, what, _, _, attrs in spans] == [
        ("r0", "agent.turn", "assistant", 2), ("r0", "agent.turn", "tool", 1)]
    (_, _, first_start, first_end, _), (_, _, second_start, second_end, _) = spans
    assert first_start <= first_end == second_start <= second_end
