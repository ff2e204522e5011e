"""Structured output: a run whose outcome is a typed value rather than text.

``Agent.run(..., output_type=City)`` adds one tool to that run, ``final_result``, whose arguments
are the output: its JSON schema is ``City``'s (pydantic's ``TypeAdapter``), and a type whose schema
is not an object (``list[str]``, ``int``, a ``Literal``, a union) is wrapped as ``{"result": ...}``.
The output is a tool call rather than a reply format because every provider has tool calls, and
because what happens to a call is already the loop's business:

- a valid call is a result with ``terminate`` set and the validated value (as JSON data) in its
  ``details``, so the run ends without a model call to read it back (``decide``), unless other calls
  of the same turn did not end it, when the model gets one more turn;
- invalid arguments are an error result listing what failed, like any tool's; the model mends them,
  and the repeated-failure guard stops a model that cannot;
- a model that answers in words instead is told, with a system message, to call ``final_result``:
  at most ``retries`` times a run, after which the run ends with stop reason ``output_missing``.

The output is read back from the history (the last valid ``final_result`` result since the last
user message), so a run continued from a stored history finds it there as well.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Generic, TypeVar
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, create_model

from agentloop.loop.hooks import Hooks, TurnInfo
from agentloop.loop.state import LoopConfig, RunState
from agentloop.messages import AssistantMessage, Message, ToolResultMessage, UserMessage, system
from agentloop.tools.base import (
    SchemaTool,
    Tool,
    ToolArgumentsError,
    ToolContext,
    ToolResult,
    _strip_titles,
    format_validation_error,
)

OUTPUT_TOOL = "final_result"
#: the stop reason of a run that asked for an output and ended without one
OUTPUT_MISSING = "output_missing"
DEFAULT_RETRIES = 2
NUDGE_KIND = "output"

OutputT = TypeVar("OutputT")


def check_retries(retries: object) -> int:
    """``output_retries`` as given, or ``ValueError``."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"output_retries must be a whole number of at least 0, got {retries!r}")
    return retries


class OutputSpec(Generic[OutputT]):
    """What a run must produce: the type, its output tool, and how often a text answer is nudged.

    Raises ``TypeError`` when pydantic can neither validate ``output_type`` nor describe it as a
    JSON schema.
    """

    def __init__(self, output_type: Any, *, retries: int = DEFAULT_RETRIES, name: str = OUTPUT_TOOL) -> None:
        self.type = output_type
        self.retries = check_retries(retries)
        self.name = name
        try:
            self.adapter: TypeAdapter[OutputT] = TypeAdapter(output_type)
            schema = self.adapter.json_schema()
            as_object = _as_object(schema)
            self.wrapped = as_object is None
            self.arguments: TypeAdapter[Any] = self.adapter  # what a call's arguments are validated as
            if as_object is not None:
                schema = as_object
            else:  # a tool's arguments are an object: the value is its one field
                wrapper: type[BaseModel] = create_model(
                    name, __config__=ConfigDict(arbitrary_types_allowed=True), result=(output_type, ...)
                )
                self.arguments = TypeAdapter(wrapper)
                schema = self.arguments.json_schema()
        except Exception as exc:  # pydantic's schema errors are TypeErrors; say which argument it was
            raise TypeError(f"output_type {output_type!r} is not a type pydantic can validate: {exc}") from exc
        self.tool = OutputTool(self, _strip_titles(schema))

    def check(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """A call's arguments validated (and coerced) and dumped as JSON data, or
        ``ToolArgumentsError`` saying what does not fit."""
        try:
            value = self.arguments.validate_python(arguments)
        except ValidationError as exc:
            errors = [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()]
            raise ToolArgumentsError(format_validation_error(self.name, errors, arguments)) from None
        data: dict[str, Any] = self.arguments.dump_python(value, mode="json")
        return data

    def output_of(self, messages: list[Message]) -> OutputT | None:
        """The output in ``messages``: the last valid ``final_result`` result since the last user
        message, validated again from its ``details``; None when there is none."""
        for msg in reversed(messages):
            if isinstance(msg, UserMessage):
                return None
            if isinstance(msg, ToolResultMessage) and msg.tool_name == self.name and not msg.is_error:
                try:
                    return self.adapter.validate_python(msg.details)
                except ValidationError:  # a result a hook rewrote: not an output
                    continue
        return None

    def prepare(self, config: LoopConfig, state: RunState) -> LoopConfig:
        """``config`` for one run: the output tool among its tools and a hook that nudges a text
        answer. The agent's own tools and hooks are left as they are."""
        if self.name in config.tools:
            raise ValueError(f"a tool is already named {self.name!r}, the output tool's name")
        hooks = Hooks(
            before=list(config.hooks.before),
            after=list(config.hooks.after),
            transform=list(config.hooks.transform),
            inputs=list(config.hooks.inputs),
            provider_request=list(config.hooks.provider_request),  # (else an output run sends without them)
            phases={phase: list(fns) for phase, fns in config.hooks.phases.items()},
            timeout=config.hooks.timeout,
        )
        nudged = 0

        def nudge(info: TurnInfo) -> None:
            """After a turn that answered in words, with no output yet: ask for the call."""
            nonlocal nudged
            last = state.messages[-1] if state.messages else None
            if not isinstance(last, AssistantMessage) or last.tool_calls or last.stop_reason != "stop":
                return
            if state.guard or state.stopping or state.aborted or state.steering or state.follow_up:
                return  # ending anyway, or input waits (answered first; the answer after it is checked)
            if nudged >= self.retries or self.output_of(state.messages) is not None:
                return
            nudged += 1
            state.follow_up.append(system(self.instruction, NUDGE_KIND))

        hooks.on("post_turn")(nudge)
        return replace(config, tools={**config.tools, self.name: self.tool}, hooks=hooks)

    @property
    def instruction(self) -> str:
        """The nudge after a text answer (a system message of kind ``output``)."""
        return f"Call {self.name} with your answer: the answer must be given as that tool's arguments, not as text."


def _as_object(schema: dict[str, Any]) -> dict[str, Any] | None:
    """``schema`` when it describes an object (a recursive model's is a reference to one, which
    is followed); None when the value needs wrapping to be a tool's arguments."""
    if schema.get("type") == "object":
        return schema
    ref, defs = schema.get("$ref"), schema.get("$defs")
    if set(schema) == {"$ref", "$defs"} and isinstance(ref, str) and isinstance(defs, dict):
        target = defs.get(ref.removeprefix("#/$defs/"))
        if isinstance(target, dict) and target.get("type") == "object":
            return {**target, "$defs": defs}
    return None


class OutputTool(Tool):
    """The tool whose valid call is the run's output (see the module docstring)."""

    def __init__(self, spec: OutputSpec[Any], parameters: dict[str, Any]) -> None:
        super().__init__(
            spec.name,
            "Give your final answer by calling this tool: its arguments are the answer. "
            "Call it once, when you have the answer.",
            parameters,
        )
        self._spec = spec

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return self._spec.check(arguments)

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        details = arguments["result"] if self._spec.wrapped else arguments
        return ToolResult.text("Final answer received.", details=details, terminate=True)


# ------------------------------------------------------------------ an output given as a JSON Schema

#: the largest output schema a durable run takes, as compact JSON
MAX_SCHEMA_BYTES = 64 * 1024
#: the most schema nodes one validation of a durable run's output may visit, ``$ref`` followed: a
#: small schema whose references fan out (``allOf`` of two refs, each to a level below) could
#: otherwise cost exponential time on the event loop for every call
MAX_SCHEMA_NODES = 20_000
# keywords whose values are regular expressions the server would run on the model's arguments: a
# caller's pattern with nested quantifiers (``^(a+)+$``) could hold the event loop for hours
_REGEX_KEYWORDS = ("pattern", "patternProperties")


def output_schema_of(output: Any) -> dict[str, Any]:
    """What a caller asked for as a durable run's output, as the JSON Schema kept with the run: a
    JSON Schema (a dict, checked) as it is, or a type pydantic can describe (a model, ``list[str]``)
    as ``TypeAdapter(output).json_schema()`` without pydantic's titles. ``ValueError`` for a schema
    that is not a valid JSON Schema, is not JSON, or is larger than ``MAX_SCHEMA_BYTES``."""
    if isinstance(output, dict):
        schema = output
    elif isinstance(output, (bool, int, float, str, list, tuple)) or output is None:
        raise ValueError(f"output_schema must be a JSON Schema object or a type, got {type(output).__name__}")
    else:
        try:
            schema = _strip_titles(TypeAdapter(output).json_schema())
        except Exception as exc:
            raise ValueError(f"output_schema {output!r} is not a type pydantic can describe: {exc}") from exc
    SchemaOutput(schema)  # checked: what is kept can be made into the run's tool
    return schema


class SchemaOutput:
    """The output of a durable run, as a JSON Schema (what an API client can send): its
    ``final_result`` tool, validated with ``jsonschema``; a schema that is not an object's is
    wrapped as ``{"result": ...}``, as ``OutputSpec`` wraps a type. ``ValueError`` for a schema
    that is not valid, not JSON, or larger than ``MAX_SCHEMA_BYTES``."""

    def __init__(self, schema: dict[str, Any], *, retries: int = DEFAULT_RETRIES, name: str = OUTPUT_TOOL) -> None:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        if not isinstance(schema, dict):
            raise ValueError(f"output_schema must be a JSON object, got {type(schema).__name__}")
        try:
            size = len(json.dumps(schema, separators=(",", ":"), allow_nan=False).encode())
        except (TypeError, ValueError) as exc:
            raise ValueError(f"output_schema is not JSON: {exc}") from None
        if size > MAX_SCHEMA_BYTES:
            raise ValueError(f"output_schema is {size} bytes as JSON, more than {MAX_SCHEMA_BYTES}")
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"output_schema is not a valid JSON Schema: {exc.message}") from None
        _check_cost(schema)
        self.schema = schema
        self.retries = check_retries(retries)
        self.name = name
        as_object = _as_object(schema)
        self.wrapped = as_object is None
        if as_object is not None:
            parameters = as_object
        else:  # the value is the one field of the arguments; its definitions move up with it
            inner = {k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$schema")}
            inner = _moved_refs(inner)  # ("#" was the schema itself: now it is the wrapper)
            parameters = {"type": "object", "properties": {"result": inner}, "required": ["result"]}
            parameters.update({k: schema[k] for k in ("$defs", "definitions") if k in schema})
        self.tool = SchemaOutputTool(self, parameters)

    def output_of(self, messages: list[Message]) -> Any:
        """The output in ``messages``: the value of the last valid ``final_result`` result since
        the last user message; None when there is none."""
        return output_in(messages, self.name)

    @property
    def instruction(self) -> str:
        return f"Call {self.name} with your answer: the answer must be given as that tool's arguments, not as text."


def _check_cost(schema: dict[str, Any]) -> None:
    """``ValueError`` for a schema whose validation the server could not bound: one that names a
    regular expression (``pattern``, ``patternProperties``), or whose nodes, each ``$ref`` followed
    (but not into itself again: recursion is fine), number more than ``MAX_SCHEMA_NODES``."""
    visited = 0

    def walk(node: Any, path: tuple[str, ...]) -> None:
        nonlocal visited
        visited += 1
        if visited > MAX_SCHEMA_NODES:
            raise ValueError(
                f"output_schema is too complex: checking it would visit more than {MAX_SCHEMA_NODES} schema nodes"
            )
        if isinstance(node, list):
            for item in node:
                walk(item, path)
            return
        if not isinstance(node, dict):
            return
        for key in _REGEX_KEYWORDS:
            if key in node:
                raise ValueError(
                    f"output_schema may not use {key!r}: the server does not run a caller's regular expressions"
                )
        for key, value in node.items():
            if key in ("$defs", "definitions", *_DATA_KEYWORDS):
                continue  # (definitions are walked where they are referred to; values are data)
            if key == "$ref" and isinstance(value, str):
                if value not in path:  # (a reference back into itself ends there)
                    walk(_resolve(schema, value), (*path, value))
            elif key == "properties" and isinstance(value, dict):
                for sub in value.values():  # (the names are data, the values schemas)
                    walk(sub, path)
            else:
                walk(value, path)

    walk(schema, ("#",))
    _check_progress(schema)


# The keywords whose subschemas apply to the value itself, not to a part of it: a ``$ref`` cycle
# through these only would be checked again and again on the same value, without end.
_DATA_KEYWORDS = ("enum", "const", "examples", "default")
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas")


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    """The node a ``$ref`` within ``schema`` names (a JSON pointer, ``#/...``); None for an anchor
    (``#name``, the validator's to find). ``ValueError`` for a reference outside the schema, or to
    a place it does not have: no answer could be checked against it."""
    if not ref.startswith("#"):
        raise ValueError(f"output_schema may refer only within itself, not to {ref!r}")
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: Any = schema
    for part in (p for p in ref[1:].split("/") if p):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"output_schema refers to {ref!r}, which it does not define")
    return node


def _check_progress(schema: dict[str, Any]) -> None:
    """``ValueError`` for a ``$ref`` that leads back to where it started without descending into
    the value (``{"$defs": {"a": {"$ref": "#/$defs/a"}}}``, ``{"allOf": [{"$ref": "#"}]}``):
    checking an answer would recurse without end. Recursion through ``properties``, ``items`` and
    the like is fine: each step is a smaller part of the value."""

    def next_nodes(node: Any) -> list[Any]:
        if not isinstance(node, dict):
            return []
        found: list[Any] = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.append(_resolve(schema, ref))
        for key in _IN_PLACE:
            value = node.get(key)
            if isinstance(value, list):
                found.extend(value)
            elif key == "dependentSchemas" and isinstance(value, dict):
                found.extend(value.values())
            elif isinstance(value, dict):
                found.append(value)
        return [n for n in found if isinstance(n, dict)]

    done: set[int] = set()
    for start in _schema_nodes(schema):
        if id(start) in done:
            continue
        on_path = {id(start)}
        stack = [(start, iter(next_nodes(start)))]
        while stack:
            node, todo = stack[-1]
            child = next(todo, None)
            if child is None:
                stack.pop()
                on_path.discard(id(node))
                done.add(id(node))
            elif id(child) in on_path:
                raise ValueError(
                    "output_schema has a $ref that leads back to itself without descending into the value:"
                    " no answer could ever be checked against it"
                )
            elif id(child) not in done:
                on_path.add(id(child))
                stack.append((child, iter(next_nodes(child))))


def _schema_nodes(node: Any) -> list[dict[str, Any]]:
    """Every object in ``node`` but its values (``enum``, ``const`` …: data, not schemas)."""
    found: list[dict[str, Any]] = []
    todo = [node]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            found.append(item)
            todo.extend(v for k, v in item.items() if k not in _DATA_KEYWORDS)
        elif isinstance(item, list):
            todo.extend(item)
    return found


def _moved_refs(node: Any) -> Any:
    """``node`` with its references into the schema (``#``, ``#/items``, but not ``#/$defs/...``,
    which move up with it) pointed at where the schema now is: ``#/properties/result``."""
    if isinstance(node, list):
        return [_moved_refs(item) for item in node]
    if not isinstance(node, dict):
        return node
    moved = {k: _moved_refs(v) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (
        ref == "#" or (ref.startswith("#/") and not ref.startswith(("#/$defs/", "#/definitions/")))
    ):
        moved["$ref"] = "#/properties/result" + ref[1:]
    return moved


def output_in(messages: list[Message], name: str = OUTPUT_TOOL) -> Any:
    """The value of the last valid ``name`` result (a terminating one, with its ``details``) since
    the last user message in ``messages``; None when there is none."""
    for msg in reversed(messages):
        if isinstance(msg, UserMessage):
            return None
        if (
            isinstance(msg, ToolResultMessage)
            and msg.tool_name == name
            and msg.terminate
            and not msg.is_error
            and msg.details is not None
        ):
            return msg.details
    return None


class SchemaOutputTool(SchemaTool):
    """``final_result`` of a run whose output is a JSON Schema (see ``SchemaOutput``)."""

    def __init__(self, spec: SchemaOutput, parameters: dict[str, Any]) -> None:
        async def unused(**_: Any) -> None:  # (``run`` below answers)
            return None

        super().__init__(
            spec.name,
            "Give your final answer by calling this tool: its arguments are the answer. "
            "Call it once, when you have the answer.",
            parameters,
            unused,
        )
        self.output = spec

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        details = arguments["result"] if self.output.wrapped else arguments
        return ToolResult.text("Final answer received.", details=details, terminate=True)
