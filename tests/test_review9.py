"""Review of the tool timeout task, Read/Fetch limits, ToolRetry and audio input (review 9): each
test fails before its fix.

- A tool under a timeout copies who waits for it into everything it starts: a callback or task
  it left behind, once the tool was done, still counted the run's task as "its own", so its
  ``Run.abort`` never cancelled the run (it ran on until the next check).
- An error a tool raised while an abort cancelled it was never retrieved: asyncio logged it as
  an error ("Task exception was never retrieved") when the task was collected.
- Fetch took an untyped (or ``application/octet-stream``) UTF-16 body for binary by its NUL
  bytes before its byte-order mark was read.
- A retried spawn with audio transcribed it again before finding its first receipt: a second
  cost, and a transcriber failing now refused an input delivered the first time.
- ToolRetry counted a person's "no" (``Tool execution denied by user``) as a retryable
  permission failure, so a second denial ended the run; and it put Edit's not-unique
  ``old_string``, Read's offset past the end, a binary file and Fetch's refusal of a private
  address in the wrong classes.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Block, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.loop import execute
from agentloop.loop.tool_retry import ToolFailure, ToolRetry, classify_failure
from agentloop.messages import ToolCall
from agentloop.process.audio_video import AudioContent
from agentloop.tools import fetch
from agentloop.tools.base import ToolContext, ToolError
from agentloop.tools.builtin import builtin_tools

# -- the tool's own task ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["callback", "task"])
async def test_what_a_finished_tool_left_behind_can_abort_its_run(how: str) -> None:
    """A watchdog a tool starts (``call_later``, or a task) is no part of the tool once the tool
    has returned: its abort cancels the run. Before, it inherited the tool's waiters and spared
    the run's task, which went on through a 5 s tool call."""
    holder: dict[str, Any] = {}

    async def watchdog() -> None:
        await asyncio.sleep(0.1)
        holder["run"].abort()

    @tool(timeout=30)
    async def arm() -> str:
        """Arm a watchdog."""
        if how == "callback":
            asyncio.get_running_loop().call_later(0.1, holder["run"].abort)
        else:
            holder["watchdog"] = asyncio.create_task(watchdog())
        return "armed"

    @tool(timeout=30)
    async def slow() -> str:
        """Take a while."""
        await asyncio.sleep(5)
        return "done"

    model = ScriptedModel([Reply(tool_calls=[call("arm")]), Reply(tool_calls=[call("slow")]), "end"])
    run = Agent(model=model, tools=[arm, slow]).start("go")
    holder["run"] = run
    started = time.monotonic()
    result = await asyncio.wait_for(run.result(), 10)
    assert result.stop_reason == "aborted"
    assert time.monotonic() - started < 2  # the abort, not the end of ``slow``
    armed, cancelled = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert armed.text == "armed" and cancelled.text == execute.CANCELLED


async def test_a_tool_still_running_may_abort_its_own_run_through_a_task_it_waits_for() -> None:
    """The sparing still holds while the tool runs: a task the tool awaits (a nested call's)
    aborts the run and the tool finishes what it does."""
    holder: dict[str, Any] = {}
    finished: list[str] = []

    @tool(timeout=30)
    async def stop_now() -> str:
        """Stop the run from a helper task, then tidy up."""

        async def helper() -> None:
            holder["run"].abort()

        await asyncio.create_task(helper())
        await asyncio.sleep(0.01)  # (a cancel would land here)
        finished.append("tidied")
        return "stopping"

    model = ScriptedModel([Reply(tool_calls=[call("stop_now")]), "must not be called"])
    run = Agent(model=model, tools=[stop_now]).start("go")
    holder["run"] = run
    result = await asyncio.wait_for(run.result(), 5)
    assert result.stop_reason == "aborted" and model.calls == 1
    assert finished == ["tidied"]


async def test_an_error_raised_by_a_tool_an_abort_cancels_is_not_logged_as_never_retrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def work() -> Any:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        waiting = asyncio.create_task(execute._within(30, work(), ToolCall(id="c1", name="bad")))
        await asyncio.sleep(0.05)
        waiting.cancel()  # an abort
        with pytest.raises(asyncio.CancelledError):
            await waiting
        del waiting
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.01)
    assert "never retrieved" not in caplog.text


# -- Fetch ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["", "application/octet-stream"])
async def test_an_untyped_utf16_body_is_read_as_text(content_type: str) -> None:
    body = "Hello, wörld\nline two\n".encode("utf-16")  # (with its byte-order mark)
    text, blocks = await fetch._render(body, content_type, False, "https://example.com/a", 10_000, 1 << 20)
    assert text == "Hello, wörld\nline two\n" and blocks == []
    page = "<!DOCTYPE html><html><body><p>Hi there</p></body></html>".encode("utf-16-be")
    text, _ = await fetch._render(b"\xfe\xff" + page, content_type, False, "https://example.com/", 10_000, 1 << 20)
    assert "Hi there" in text and "<p>" not in text  # (told for HTML by its decoded head)
    # bytes with NULs and no mark are still binary
    text, _ = await fetch._render(b"\x01\x00\x02\x00" * 10, content_type, False, "https://x/", 10_000, 1 << 20)
    assert text.startswith("[binary body")


# -- a retried spawn with audio -------------------------------------------------------------------


@dataclass
class Transcriber:
    error: Exception | None = None
    asked: list[str] = field(default_factory=list)

    async def transcribe(self, audio: bytes, filename: str, mime: str) -> str:
        self.asked.append(filename)
        if self.error is not None:
            raise self.error
        return "hello from the memo"


async def test_a_retried_spawn_with_audio_is_not_transcribed_again(tmp_path: Path) -> None:
    memo = AudioContent(base64.b64encode(b"OggS" + bytes(100)).decode(), "audio/ogg", "memo.ogg")
    fake = Transcriber()
    model = ScriptedModel(lambda req: "ok")
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, workspace=tmp_path, transcriber=fake) as kernel:
        first = await kernel.spawn("alice", pid="p1", text="listen", media=[memo], run_id="r1")
        await first.wait_idle()
        fake.error = RuntimeError("the service is down")  # (a retry must not depend on it)
        again = await kernel.spawn("alice", pid="p1", text="listen", media=[memo], run_id="r1")
        assert again.pid == "p1" and again.started == first.started
        assert fake.asked == ["memo.ogg"]
        history = [m.message for m in await first.history()]
        assert [m.text for m in history[:1]] == ['listen\n\n[Transcribed audio file "memo.ogg"]: hello from the memo']


# -- ToolRetry ------------------------------------------------------------------------------------


async def test_a_persons_denials_are_not_counted_against_the_budgets(tmp_path: Path) -> None:
    """Two calls a person denied (the CLI's and the approval layer's words) must not end the
    run: before, each was a retryable permission failure, and the second spent its budget of 1."""
    (tmp_path / "a.txt").write_text("a\n")
    model = ScriptedModel(
        [
            Reply(tool_calls=[call("Read", path="a.txt")]),
            Reply(tool_calls=[call("Read", path="a.txt", offset=1)]),
            Reply(tool_calls=[call("Read", path="a.txt", limit=5)]),
            "done",
        ]
    )
    agent = Agent(model=model, tools=builtin_tools(tmp_path, shell=False, fetch=False), pieces=[ToolRetry()])
    agent.hooks.before_tool_call(lambda info: Block("Tool execution denied by user"))
    result = await asyncio.wait_for(agent.run("go"), 10)
    assert result.stop_reason == "stop" and result.text == "done"
    assert all("budget exhausted" not in r.system_prompt for r in model.requests)
    verdict = classify_failure(ToolFailure("Read", {}, "Tool execution denied by user", None, executed=False))
    assert verdict.error_class == "permission_denied" and not verdict.retryable
    words = "Tool execution denied by user, with this message from the user:\n\nnot that file"
    assert not classify_failure(ToolFailure("Read", {}, words, None, executed=False)).retryable


async def test_built_in_tool_failures_get_their_classes(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("ab\nab\n")
    (tmp_path / "bin.dat").write_bytes(b"\x00\x01" * 8)
    tools = {t.name: t for t in builtin_tools(tmp_path)}

    async def failed(name: str, **args: Any) -> str:
        tool_ = tools[name]
        try:
            result = await tool_.run(tool_.validate(args), ToolContext("c", name, tmp_path))
        except ToolError as exc:
            text = str(exc)
        else:
            assert result.is_error
            text = result.text
        return classify_failure(ToolFailure(name, args, text, None, executed=True)).error_class

    assert await failed("Edit", path="a.txt", old_string="ab", new_string="x") == "invalid_arguments"  # not unique
    assert await failed("Read", path="a.txt", offset=9) == "invalid_arguments"  # past the end
    assert await failed("Read", path="bin.dat") == "invalid_arguments"
    assert await failed("Edit", path="bin.dat", old_string="a", new_string="b") == "invalid_arguments"
    assert await failed("Fetch", url="http://10.1.2.3/") == "permission_denied"  # refused: not public
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert await failed("Delete", path="full") == "invalid_arguments"  # a directory that is not empty
    # unchanged: what the tests of the piece pin
    assert await failed("Read", path="nope.txt") == "not_found"
    assert await failed("Edit", path="a.txt", old_string="zz", new_string="x") == "invalid_arguments"


def test_a_tool_result_made_from_a_string_is_one_text_block() -> None:
    """``ToolResult("done")`` was taken as a list of one-character blocks (the model got "d", "o",
    "n", "e" as four blocks, and ToolRetry split its text the same way); anything else that is no
    list of blocks is a clear TypeError where the result is made, not a failure later."""
    from agentloop.messages import TextContent
    from agentloop.tools.base import ToolResult

    assert ToolResult("done").content == [TextContent(text="done")]
    assert ToolResult((TextContent(text="a"),)).content == [TextContent(text="a")]
    with pytest.raises(TypeError, match="list of blocks or a text, got int"):
        ToolResult(5)  # type: ignore[arg-type]
