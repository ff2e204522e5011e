"""The JSON a device and the server exchange for one call's result: ``{"content": [blocks],
"is_error": bool}``, blocks in agentloop's message format (``text``; ``image`` with ``mimeType``).

Both ends use these two functions, so what a device sends is exactly what the hub reads back.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from agentloop.messages import TextContent, UserBlock
from agentloop.tools.base import ResultBlock, ToolResult

__all__ = ["result_from_wire", "result_to_wire"]

_BLOCKS: TypeAdapter[list[UserBlock]] = TypeAdapter(list[UserBlock])
_BLOCK: TypeAdapter[UserBlock] = TypeAdapter(UserBlock)


def result_to_wire(result: ToolResult) -> dict[str, Any]:
    """A tool result as a device answers it (``details`` stay on the device: they need not be JSON)."""
    content: list[dict[str, Any]] = _BLOCKS.dump_python(list(result.content), mode="json")
    return {"content": content, "is_error": result.is_error}


def result_from_wire(data: Any) -> ToolResult | None:
    """The tool result in a device's answer, or None if the answer is malformed. A block of a
    known kind that is not valid (a document of a type no model takes) is left out with a note,
    the rest kept."""
    content = data.get("content", []) if isinstance(data, dict) else None
    if not isinstance(content, list) or not isinstance(data.get("is_error", False), bool):
        return None
    blocks: list[ResultBlock] = []
    for raw in content:
        if not isinstance(raw, dict) or raw.get("type") not in ("text", "image", "file"):
            return None
        try:
            blocks.append(_BLOCK.validate_python(raw))
        except ValidationError as exc:
            why = exc.errors(include_url=False)[0]["msg"]
            blocks.append(TextContent(text=f"[a block of the result was left out: {why}]"))
    return ToolResult(blocks or [TextContent(text="")], is_error=bool(data.get("is_error", False)))
