"""Review 3 (durable structured output, Delegate, tracing, web UI): failing-first tests of the
defects found. Each test is named after the defect; its docstring says what is wrong and why it
matters."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from agentloop.loop.output import SchemaOutput, output_schema_of
from agentloop.tools.base import ToolArgumentsError

# ------------------------------------------------------------------ output_schema: cost of validation


def _validates_within(schema_src: str, arguments_src: str, seconds: float) -> bool:
    """Whether ``SchemaOutput(output_schema_of(schema)).tool.validate(arguments)`` returns (or
    refuses the schema) within ``seconds``, run in a child process so a test that fails does not
    leave a thread burning CPU."""
    program = textwrap.dedent(
        f"""
        from agentloop.loop.output import SchemaOutput, output_schema_of
        schema = {schema_src}
        try:
            kept = output_schema_of(schema)
        except ValueError:
            raise SystemExit(0)  # refused at the door: fine
        try:
            SchemaOutput(kept).tool.validate({arguments_src})
        except Exception:
            pass
        """
    )
    try:
        subprocess.run([sys.executable, "-c", program], timeout=seconds, check=True, capture_output=True)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_output_schema_with_exponential_ref_fanout_blocks_the_event_loop() -> None:
    """``output_schema_of`` bounds a schema by its size (64 KiB) only. A 2 KB schema whose
    ``$defs`` chain each level to the next twice (``allOf: [$ref d(i+1), $ref d(i+1)]``) costs
    2**depth evaluations for ANY ``final_result`` call: depth 16 already takes ~1.6 s, depth 30
    hours. ``SchemaTool.validate`` runs synchronously on the event loop (``loop/execute._check``,
    from the durable dispatch), so one account's API request (``POST .../messages`` with
    ``output_schema``) plus the model doing exactly what it is told (call ``final_result``)
    freezes the whole server, every account's processes with it. Such a schema should be refused
    (a budget on ``$ref`` expansion / composition), or validated off the loop with a deadline."""
    depth = 30
    schema = (
        "{'type': 'object', 'properties': {'x': {'$ref': '#/$defs/d0'}}, '$defs': {"
        + ", ".join(
            f"'d{i}': {{'allOf': [{{'$ref': '#/$defs/d{i + 1}'}}, {{'$ref': '#/$defs/d{i + 1}'}}]}}"
            for i in range(depth)
        )
        + f", 'd{depth}': {{'type': 'string'}}}}}}"
    )
    assert _validates_within(schema, "{'x': 'a'}", 10.0), "validating one final_result call did not end in 10 s"


def test_output_schema_with_catastrophic_pattern_blocks_the_event_loop() -> None:
    """A ``pattern`` is compiled and run by Python's backtracking ``re`` (jsonschema's
    ``pattern`` keyword) on the event loop: ``^(a+)+$`` against 40 ``a`` and a ``!`` (a value
    the owner's prompt can ask the model for) takes hours. Same consequence as the ``$ref``
    fan-out: one account's output schema stops every process on the server. Patterns need a
    guard (refuse nested quantifiers, a length cap on checked strings, or a time-limited
    matcher)."""
    schema = "{'type': 'object', 'properties': {'x': {'type': 'string', 'pattern': '^(a+)+$'}}}"
    assert _validates_within(schema, "{'x': 'a' * 40 + '!'}", 10.0), "validating one final_result call did not end"


# ------------------------------------------------------------------ output_schema: wrapping


def test_wrapped_output_schema_root_ref_points_at_the_wrapper_not_the_schema() -> None:
    """A schema that is not an object's is wrapped as ``{"result": <schema>}`` (docs/server-api.md,
    *Structured output*); ``$defs`` move up, but a reference to the schema's own root (``"$ref":
    "#"``, how a recursive JSON Schema is written: nested lists, trees) now resolves to the
    WRAPPER object. A valid value such as ``[1, [2, 3]]`` for "an int or a list of these" is then
    refused as invalid arguments, so the model can never give the output the caller asked for:
    the run loops on validation errors, then ends ``output_missing``."""
    nested = {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"$ref": "#"}]}}
    spec = SchemaOutput(output_schema_of(nested))
    assert spec.wrapped
    try:
        spec.tool.validate({"result": [1, [2, 3]]})
    except ToolArgumentsError as exc:
        pytest.fail(f"a value valid for the caller's schema was refused: {exc}")


# ------------------------------------------------------------------ tracing


def test_kernel_tracing_mixes_up_runs_of_different_processes_with_the_same_run_id() -> None:
    """``KernelTracing._runs`` is keyed by run id alone, but run ids are unique per process only:
    the heartbeat gives every process it beats in one period the same id
    (``heartbeat:<period start>``, kernel/heartbeat.py), and client-supplied ``run_id``s are
    per-process idempotency keys. Two such runs at once: the second's ``_start`` overwrites the
    first's entry, so the first's ``invoke_agent`` span is never ended (never exported, a leak),
    the first's ``proc.run.finished`` ends the SECOND process's span with the first's usage and
    status, and the second's end then opens and ends a bogus "resumed" span."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentloop.process import signals as sig
    from agentloop.process.signals import Signal, SignalHub
    from agentloop.tracing import trace_kernel

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    class FakeEngine:
        def __init__(self) -> None:
            self.hub = SignalHub()
            self.closed_hooks: list[Any] = []

        def cached(self, pid: str) -> None:
            return None

    class FakeKernel:
        engine = FakeEngine()

    k = FakeKernel()
    tracing = trace_kernel(k, tracer_provider=provider)  # type: ignore[arg-type]
    hub = k.engine.hub
    rid = "heartbeat:1764172800"
    hub.publish("p1", Signal(sig.RUN_STARTED, {"runId": rid, "reason": "heartbeat"}))
    hub.publish("p2", Signal(sig.RUN_STARTED, {"runId": rid, "reason": "heartbeat"}))
    hub.publish(
        "p1",
        Signal(
            sig.RUN_FINISHED,
            {"runId": rid, "status": "ok", "reason": "turn.complete", "usage": {"input": 1, "output": 1}},
        ),
    )
    hub.publish(
        "p2",
        Signal(
            sig.RUN_FINISHED,
            {"runId": rid, "status": "error", "reason": "model.error", "usage": {"input": 7, "output": 7}},
        ),
    )
    tracing.close()
    runs = [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]
    by_pid = {str((s.attributes or {}).get("gen_ai.conversation.id")): s for s in runs}
    assert len(runs) == 2 and set(by_pid) == {"p1", "p2"}, [
        (s.attributes or {}).get("gen_ai.conversation.id") for s in runs
    ]
    assert all("agentloop.run.incomplete" not in (s.attributes or {}) for s in runs)
    assert (by_pid["p1"].attributes or {}).get("gen_ai.usage.input_tokens") == 1
