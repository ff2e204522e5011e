"""Tool results reach the model within a size limit (``Tool.max_result_chars``): a runaway
result is cut to its start and end around a note, in both runners, and stored cut."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentloop import Agent, Reply, ScriptedModel, ToolResult, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import ImageContent, TextContent, ToolCall
from agentloop.models.base import ModelRequest
from agentloop.tools.base import MAX_RESULT_CHARS

BIG = "A" * 1000 + "m" * 300_000 + "Z" * 1000


@tool
def dump() -> str:
    """Print a huge log."""
    return BIG


@tool(max_result_chars=None)
def dump_all() -> str:
    """Print a huge log, all of it."""
    return BIG


@tool(max_result_chars=2_000)
def small() -> str:
    """Print a log with a small limit."""
    return BIG


def results_seen(model: ScriptedModel) -> list[str]:
    request: ModelRequest = model.requests[-1]
    return [m.text for m in request.messages if isinstance(m, ToolResultMessage)]


def assert_cut(text: str, limit: int) -> None:
    head = limit * 2 // 3
    assert text.startswith(BIG[:head]) and text.endswith(BIG[head - limit :])  # the start and the end are kept
    assert f"{len(BIG) - limit} characters cut" in text and f"the result had {len(BIG)}" in text
    assert limit < len(text) < limit + 300  # the allowance plus the note


@pytest.mark.parametrize(("fn", "limit"), [(dump, MAX_RESULT_CHARS), (small, 2_000)])
async def test_the_in_memory_runner_cuts_a_big_result(fn, limit: int) -> None:
    model = ScriptedModel([Reply(tool_calls=[call(fn.name)]), "ok"])
    await Agent(model=model, tools=[fn]).run("go")
    [seen] = results_seen(model)
    assert_cut(seen, limit)


async def test_no_limit_means_the_whole_result() -> None:
    model = ScriptedModel([Reply(tool_calls=[call("dump_all")]), "ok"])
    await Agent(model=model, tools=[dump_all]).run("go")
    assert results_seen(model) == [BIG]


async def test_the_durable_runner_stores_and_sends_the_cut_result(tmp_path: Path) -> None:
    model = ScriptedModel([Reply(tool_calls=[call("dump")]), "ok"])
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, tools=[dump], workspace=tmp_path) as kernel:
        proc = await kernel.spawn(owner="me")
        await proc.send("go")
        await proc.wait_idle()
        stored = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert len(stored) == 1
    assert_cut(stored[0].text, MAX_RESULT_CHARS)
    assert results_seen(model) == [stored[0].text]


def test_capped_keeps_images_errors_and_details() -> None:
    image = ImageContent(data="aGk=", mime_type="image/png")
    result = ToolResult(
        [TextContent(text="x" * 50), image, TextContent(text="y" * 50)], details={"n": 1}, is_error=True
    )
    cut = result.capped(30)
    assert [type(b) for b in cut.content] == [TextContent, ImageContent]
    text = cut.content[0].text
    assert text.startswith("x" * 20) and text.endswith("y" * 10) and "71 characters cut" in text
    assert cut.details == {"n": 1} and cut.is_error is True
    assert result.capped(101) is result and result.capped(None) is result  # 50 + newline + 50 fits


def test_a_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_result_chars"):
        tool(max_result_chars=0)(lambda: "x")


@pytest.mark.parametrize("durable", [False, True])
async def test_a_result_with_bytes_that_were_not_utf8_is_kept_with_replacement_characters(
    tmp_path: Path, durable: bool
) -> None:
    """A tool that lists files decodes names that are not UTF-8 with surrogateescape: the lone
    surrogates have no UTF-8 form, so the durable step failed to store the result (the model was
    told it could not be recorded) and a provider would refuse it. They become U+FFFD."""

    @tool
    def listing() -> ToolResult:
        """List the files."""
        name = b"caf\xe9.txt".decode("utf-8", "surrogateescape")
        return ToolResult.text(f"{name}\nplain.txt", details={"names": [name, "plain.txt"], name: (name,)})

    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        return "saw: " + last.text if isinstance(last, ToolResultMessage) else Reply(tool_calls=[call("listing")])

    if durable:
        async with Kernel.open(
            f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain), tools=[listing], workspace=tmp_path
        ) as k:
            proc = await k.spawn(owner="me", text="list")
            await proc.wait_idle()
            messages = await proc.messages()
    else:
        messages = (await Agent(model=ScriptedModel(brain), tools=[listing]).run("list")).messages
    [result] = [m for m in messages if isinstance(m, ToolResultMessage)]
    assert not result.is_error and result.text == "caf\ufffd.txt\nplain.txt"
    kept = ["caf\ufffd.txt"] if durable else ("caf\ufffd.txt",)  # (stored as JSON: a list)
    assert result.details == {"names": ["caf\ufffd.txt", "plain.txt"], "caf\ufffd.txt": kept}
    assert messages[-1].text == "saw: caf\ufffd.txt\nplain.txt"


@pytest.mark.parametrize("durable", [False, True])
async def test_a_call_whose_arguments_are_not_json_gets_an_error_the_model_can_correct(
    tmp_path: Path, durable: bool
) -> None:
    """A provider's reply with a call whose arguments are broken JSON failed the whole model
    call (the run ended with "invalid_response", the model never saw why). The call is now
    answered with an error naming the problem and the model tries again; in a durable process it
    is answered before the approval policy is asked (it could not run anyway)."""
    seen: list[str] = []

    @tool
    def echo(text: str) -> str:
        """Echo."""
        seen.append(text)
        return text

    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if not isinstance(last, ToolResultMessage):
            return Reply(tool_calls=[ToolCall(id="b1", name="echo", invalid_arguments='{"text": "unterm')])
        if last.is_error:
            return Reply(tool_calls=[call("echo", text="fixed")])
        return "done: " + last.text

    policy = {"default": "deny", "rules": [{"match": "tool.echo", "action": "auto"}]}
    if durable:
        async with Kernel.open(
            f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain), tools=[echo], workspace=tmp_path, policy=policy
        ) as k:
            proc = await k.spawn(owner="me", text="go")
            await proc.wait_idle()
            messages = await proc.messages()
    else:
        messages = (await Agent(model=ScriptedModel(brain), tools=[echo]).run("go")).messages
    broken, fixed = (m for m in messages if isinstance(m, ToolResultMessage))
    assert broken.is_error and "The arguments of this echo call are not valid JSON" in broken.text, broken.text
    assert 'They were: {"text": "unterm' in broken.text
    assert not fixed.is_error and seen == ["fixed"] and messages[-1].text == "done: fixed"


async def test_a_scripted_call_with_a_lone_surrogate_in_its_arguments_is_stored(tmp_path: Path) -> None:
    """The test model hands its calls' arguments over as given: a lone surrogate in them failed
    the durable step. They are made storable, as a real provider's are on the way in."""

    @tool
    def echo(text: str) -> str:
        """Echo."""
        return text

    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        return (
            "saw: " + last.text
            if isinstance(last, ToolResultMessage)
            else Reply(tool_calls=[call("echo", text="a\ud800b")])
        )

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain, keep_requests=False), tools=[echo], workspace=tmp_path
    ) as k:
        proc = await k.spawn(owner="me", text="go")
        await proc.wait_idle()
        messages = await proc.messages()
    assert messages[-1].text == "saw: a\ufffdb"
