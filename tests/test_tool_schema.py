"""``@tool``: schemas from signatures and docstrings, validation with coercion, readable errors."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel

from agentloop import Tool, ToolContext, ToolResult, tool
from agentloop.messages import ImageContent, TextContent
from agentloop.tools.base import ToolArgumentsError, parse_docstring, to_result


class Point(BaseModel):
    x: int
    y: int


@tool
def move(to: Point, speed: float = 1.0, mode: Literal["walk", "run"] = "walk") -> str:
    """Move the robot.

    Args:
        to: Where to go.
        speed: Metres per second,
            never above 3.
        mode: How to move.
    """
    return f"{to.x},{to.y}@{speed}/{mode}"


def test_schema_from_signature_and_docstring():
    assert move.name == "move"
    assert move.description == "Move the robot."
    p = move.parameters
    assert p["required"] == ["to"]
    assert p["properties"]["speed"] == {
        "type": "number",
        "default": 1.0,
        "description": "Metres per second, never above 3.",
    }
    assert p["properties"]["mode"]["enum"] == ["walk", "run"]
    assert "title" not in p and "title" not in p["properties"]["speed"]
    assert "$defs" in p  # nested models are described too


def test_validation_coerces():
    args = move.validate({"to": {"x": "1", "y": 2}, "speed": "2.5"})
    assert args["to"] == Point(x=1, y=2) and args["speed"] == 2.5


def test_validation_error_is_readable():
    with pytest.raises(ToolArgumentsError) as err:
        move.validate({"to": {"x": "left"}, "mode": "fly"})
    text = str(err.value)
    assert text.startswith('Validation failed for tool "move":')
    assert "to.x:" in text and "to.y: Field required" in text and "mode:" in text
    assert '"x": "left"' in text  # the received arguments are shown back


def test_sphinx_docstrings():
    desc, params = parse_docstring("Do it.\n\n:param a: the a\n:param int b: the b\n:returns: x")
    assert desc == "Do it." and params == {"a": "the a", "b": "the b"}


async def test_context_is_injected_and_hidden_from_schema():
    seen = {}

    @tool
    async def probe(ctx: ToolContext, n: int) -> str:
        """Probe."""
        seen["id"] = ctx.tool_call_id
        ctx.update({"progress": n})
        return "ok"

    assert list(probe.parameters["properties"]) == ["n"]
    updates: list[object] = []
    ctx = ToolContext(tool_call_id="c1", tool_name="probe", update=updates.append)
    result = await probe.run(probe.validate({"n": "3"}), ctx)
    assert seen["id"] == "c1" and updates == [{"progress": 3}] and result.content[0].text == "ok"


def test_options_and_bad_names():
    @tool(name="slow-one", timeout=5, sequential=True, idempotent=True)
    def slow() -> str:
        """Slow."""
        return ""

    assert (slow.name, slow.timeout, slow.sequential, slow.idempotent) == ("slow-one", 5, True, True)
    with pytest.raises(ValueError):
        tool(name="has space")(lambda: None)
    with pytest.raises(TypeError):

        @tool
        def variadic(*args: int) -> None: ...


async def test_schema_tool_validates_with_coercion():
    async def add(a: int, b: int) -> int:
        return a + b

    t = Tool.from_schema(
        "add",
        "Add two integers.",
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
        add,
    )
    args = t.validate({"a": "2", "b": 3})
    assert args == {"a": 2, "b": 3}
    result = await t.run(args, ToolContext(tool_call_id="x", tool_name="add"))
    assert result.content[0].text == "5"
    with pytest.raises(ToolArgumentsError, match=r"b: 'b' is a required property|root: 'b' is a required"):
        t.validate({"a": 1})
    with pytest.raises(Exception):  # noqa: B017 - an invalid schema is refused at definition
        Tool.from_schema("bad", "", {"type": "nonsense"}, add)


def test_results_are_normalised():
    assert to_result("x").content == [TextContent(text="x")]
    assert to_result({"a": 1}).content[0].text == '{"a": 1}'
    img = ImageContent(data="aGk=", mime_type="image/png")
    assert to_result(img).content == [img]
    assert to_result(Point(x=1, y=2)).content[0].text == '{"x":1,"y":2}'
    assert to_result(None).content[0].text == ""
    r = ToolResult.error("bad")
    assert to_result(r) is r and r.is_error
