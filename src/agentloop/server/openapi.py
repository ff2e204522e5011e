"""The route table's entries, and the OpenAPI 3.1 document built from them.

Each HTTP route is declared once, as an ``Endpoint``: method, path, the pydantic models of its
query, body and answer, and its handler. ``api.routes`` turns the table into Starlette routes and
``document`` turns the same table into OpenAPI, so the document cannot describe a route, field or
status the server does not have (a test also compares it with the routes the app really serves).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonSchemaMode, models_json_schema

import agentloop

REF = "#/components/schemas/{model}"
_PATH_PARAM = re.compile(r"{(\w+)}")

ERROR_TEXT = {
    400: "Invalid request: the message names the field.",
    401: "No token, or an unknown or revoked token.",
    403: "The action is not the account's to take.",
    404: "Unknown (or someone else's) process or approval request.",
    409: "The state forbids it.",
    413: "The body is over the limit.",
    415: "The body is not application/json.",
    429: "The account sent too many messages this minute; Retry-After says when to try again.",
    502: "A model the request needed failed (a compaction's summary model, an audio's transcription model);"
    " nothing was changed.",
    503: "Shutting down, or the part is not enabled.",
}


class ErrorBody(BaseModel):
    """Every error answer."""

    model_config = ConfigDict(extra="forbid")
    code: str
    message: str
    current_run_id: str | None = Field(
        None,
        description="Only on a send refused for the process's run (409 run_not_current, or busy for mode reject):"
        " its run at the refusal, null when idle.",
    )


@dataclass(frozen=True)
class Endpoint:
    """One HTTP route: what it takes, what it answers, and who handles it.

    ``handler`` is None for a route served elsewhere that the document still describes
    (``/engine/chat``). ``stream`` is the model of each SSE event's data for a streaming route.
    """

    method: Literal["GET", "POST", "DELETE"]
    path: str
    summary: str
    handler: Callable[..., Awaitable[Any]] | None = None
    query: type[BaseModel] | None = None
    body: type[BaseModel] | None = None
    answer: type[BaseModel] | None = None
    status: int = 200
    auth: bool = True
    stream: type[BaseModel] | None = None
    headers: tuple[tuple[str, str], ...] = ()  # documented request headers: (name, description)
    errors: tuple[int, ...] = ()  # statuses beyond those the table implies (auth, body, pid)

    @property
    def path_params(self) -> list[str]:
        return _PATH_PARAM.findall(self.path)

    @property
    def operation_id(self) -> str:
        words = [w for w in re.split(r"[^A-Za-z0-9]+", self.path) if w and w != "v1"]
        return "_".join([self.method.lower(), *words])

    def error_statuses(self) -> list[int]:
        found = set(self.errors)
        if self.auth:
            found.add(401)
        if self.body is not None:
            found |= {400, 413, 415}
        if self.query is not None or self.headers:
            found.add(400)
        if "pid" in self.path_params:
            found.add(404)
        return sorted(found)


def _schemas(endpoints: Iterable[Endpoint]) -> tuple[dict[tuple[type[BaseModel], JsonSchemaMode], Any], dict[str, Any]]:
    wanted: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ErrorBody, "serialization")]
    for e in endpoints:
        if e.body is not None:
            wanted.append((e.body, "validation"))
        for model in (e.answer, e.stream):
            if model is not None:
                wanted.append((model, "serialization"))
    unique = list(dict.fromkeys(wanted))
    refs, top = models_json_schema(unique, ref_template=REF)
    return {
        (m, mode): schema for (m, mode), schema in refs.items() if isinstance(m, type) and issubclass(m, BaseModel)
    }, top.get("$defs", {})


def _query_parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    schema = model.model_json_schema(ref_template=REF)
    required = set(schema.get("required", ()))
    params = []
    for name, prop in schema.get("properties", {}).items():
        prop = {k: v for k, v in prop.items() if k != "title"}
        param: dict[str, Any] = {"name": name, "in": "query", "required": name in required, "schema": prop}
        if "description" in prop:
            param["description"] = prop["description"]
        params.append(param)
    return params


def _operation(e: Endpoint, refs: dict[tuple[type[BaseModel], JsonSchemaMode], Any]) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": e.operation_id, "summary": e.summary}
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in e.path_params
    ]
    if e.query is not None:
        params += _query_parameters(e.query)
    params += [
        {"name": name, "in": "header", "required": False, "description": text, "schema": {"type": "string"}}
        for name, text in e.headers
    ]
    if params:
        op["parameters"] = params
    if e.body is not None:
        required = any(f.is_required() for f in e.body.model_fields.values())
        op["requestBody"] = {
            "required": required,
            "content": {"application/json": {"schema": refs[(e.body, "validation")]}},
        }
    ok: dict[str, Any] = {"description": e.summary}
    if e.stream is not None:
        # OpenAPI 3.1 has no way to type one SSE event, so the data schema rides in an extension.
        sse = {"schema": {"type": "string"}, "x-sse-data": refs[(e.stream, "serialization")]}
        ok["content"] = {"text/event-stream": sse}
        ok["description"] = f"{e.summary} (Server-Sent Events; each event's data is JSON, see x-sse-data)"
    elif e.answer is not None:
        ok["content"] = {"application/json": {"schema": refs[(e.answer, "serialization")]}}
    error_ref = refs[(ErrorBody, "serialization")]
    responses: dict[str, Any] = {str(e.status): ok}
    for status in e.error_statuses():
        text = ERROR_TEXT.get(status, "Error.")
        responses[str(status)] = {"description": text, "content": {"application/json": {"schema": error_ref}}}
    op["responses"] = responses
    op["security"] = [{"bearer": []}] if e.auth else []
    return op


def document(endpoints: Sequence[Endpoint], *, title: str = "agentloop server") -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``endpoints``, schemas generated from their pydantic models."""
    refs, defs = _schemas(endpoints)
    paths: dict[str, dict[str, Any]] = {}
    for e in endpoints:
        paths.setdefault(e.path, {})[e.method.lower()] = _operation(e, refs)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": agentloop.__version__,
            "description": "agentloop's process API. Errors are JSON {code, message}; see docs/server-api.md.",
        },
        "paths": paths,
        "components": {
            "schemas": defs,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
