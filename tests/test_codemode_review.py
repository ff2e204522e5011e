"""CodeMode under stress: concurrent nested calls, results and arguments that do not cross the
channel as they are, tools that fail in unusual ways. Every test runs real subprocesses."""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path
from typing import Any

from agentloop.tools import codemode as codemode_module
from agentloop.tools.base import NestedVerdict, Tool, ToolContext, ToolResult
from agentloop.tools.builtin import builtin_tools
from agentloop.tools.codemode import CodeMode

_ANY_ARGS: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "integer"}}}


def program(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


async def run_direct(cm: CodeMode, code: str, **args: Any) -> ToolResult:
    """The tool on its own: no runner, so only its own ``check`` applies."""
    return await cm.run(cm.validate({"code": code, **args}), ToolContext("call-1", cm.name, call_key="key"))


async def answered_at_once(cm: CodeMode, code: str) -> ToolResult:
    """The program's result, which must come well before its 10 s timeout: a call that fails must
    fail at once, not leave the program waiting for an answer until the timeout kills it."""
    started = time.monotonic()
    result = await run_direct(cm, code, timeout=10)
    assert time.monotonic() - started < 5, text_of(result)
    return result


def text_of(result: ToolResult) -> str:
    return result.content[0].text  # type: ignore[union-attr]


class Recorder(Tool):
    """Remembers the context each call ran with: the call's id and durable key must be its own."""

    def __init__(self) -> None:
        super().__init__("Record", "records its context", _ANY_ARGS)
        self.seen: list[tuple[int, str, str | None]] = []

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        self.seen.append((arguments["n"], ctx.tool_call_id, ctx.call_key))
        return ToolResult.text(str(arguments["n"]))


class Structured(Tool):
    """A tool with an output schema whose structured value JSON cannot carry as it is."""

    def __init__(self, details: Any) -> None:
        super().__init__("Odd", "returns an odd value", _ANY_ARGS)
        self.output_schema = {"type": "object"}
        self.details = details

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return ToolResult.text("odd", details=self.details)


async def test_concurrent_nested_calls_each_get_their_own_call_id_and_key(tmp_path: Path) -> None:
    recorder = Recorder()

    async def slow_check(syscall: str, tool: str, args: dict[str, Any]) -> NestedVerdict:
        await asyncio.sleep(0.05)  # an approval takes a moment (a database, a person): calls overlap
        return NestedVerdict("allow")

    cm = CodeMode([recorder], cwd=tmp_path, check=slow_check)
    code = "print(await asyncio.gather(*(record(i) for i in range(5))))\n"
    result = await run_direct(cm, code)
    assert not result.is_error, text_of(result)
    ids = [call_id for _, call_id, _ in recorder.seen]
    keys = [key for _, _, key in recorder.seen]
    # a subagent (Task) is named by its call key: two calls sharing one would share one child
    assert len(set(ids)) == 5 and len(set(keys)) == 5, recorder.seen


async def test_a_result_with_keys_json_cannot_carry_fails_the_call_not_the_program(tmp_path: Path) -> None:
    cm = CodeMode([Structured({(1, 2): "tuple key"})], cwd=tmp_path)
    code = program(
        """
        try:
            await odd(1)
        except ToolFailed as exc:
            print("failed:", exc)
        print("went on")
        """
    )
    result = await answered_at_once(cm, code)
    assert not result.is_error and "failed: the result could not be encoded" in text_of(result)
    assert text_of(result).endswith("went on")


async def test_a_circular_result_fails_the_call_and_the_next_call_still_works(tmp_path: Path) -> None:
    circular: dict[str, Any] = {}
    circular["self"] = circular
    cm = CodeMode([Structured(circular), Recorder()], cwd=tmp_path)
    code = program(
        """
        try:
            await odd(1)
        except ToolFailed as exc:
            print("failed:", exc)
        print(await record(7))
        """
    )
    result = await answered_at_once(cm, code)
    assert not result.is_error, text_of(result)
    assert text_of(result) == "failed: the result could not be encoded\n7"


async def test_arguments_too_large_for_the_channel_fail_the_call_at_once(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(codemode_module, "_LINE_LIMIT", 1 << 16)  # (128 MiB in earnest: as a test, too slow)
    cm = CodeMode([*builtin_tools(tmp_path), Recorder()], cwd=tmp_path)
    code = program(
        """
        try:
            await write("big.txt", "x" * 100_000)
        except ToolFailed as exc:
            print("failed:", exc)
        print(await record(7))
        """
    )
    result = await answered_at_once(cm, code)
    text = text_of(result)
    assert not result.is_error and "failed: write(): the arguments are too large" in text, text
    assert text.endswith("\n7") and not (tmp_path / "big.txt").exists()


async def test_a_result_too_large_for_the_channel_fails_the_call_not_the_channel(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(codemode_module, "_LINE_LIMIT", 1 << 16)
    cm = CodeMode([Structured({"text": "z" * 100_000}), Recorder()], cwd=tmp_path)
    code = program(
        """
        try:
            await odd(1)
        except ToolFailed as exc:
            print("failed:", exc)
        print(await record(7))
        """
    )
    result = await run_direct(cm, code, timeout=10)
    text = text_of(result)
    assert not result.is_error and "failed: the result is too large" in text, text
    assert text.endswith("\n7")


async def test_garbage_past_the_line_limit_on_the_channel_does_not_stop_later_calls(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(codemode_module, "_LINE_LIMIT", 1 << 16)
    cm = CodeMode([Recorder()], cwd=tmp_path)
    code = program(
        """
        import os, sys
        os.write(int(sys.argv[1]), b"garbage " * 50_000 + b"\\n")  # the channel itself, no JSON
        print(await record(7))
        """
    )
    result = await answered_at_once(cm, code)
    assert not result.is_error and text_of(result) == "7"


class CancelledInside(Tool):
    """A tool that ends with ``CancelledError`` though nobody cancelled the call: it awaited
    something another party cancelled (a shared request, a connection's task)."""

    def __init__(self) -> None:
        super().__init__("Flaky", "awaits what someone else cancels", _ANY_ARGS)

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        shared.cancel()
        await shared
        return ToolResult.text("unreachable")


async def test_a_nested_tool_that_ends_cancelled_fails_the_call_instead_of_hanging(tmp_path: Path) -> None:
    cm = CodeMode([CancelledInside(), Recorder()], cwd=tmp_path)
    code = program(
        """
        try:
            await flaky(1)
        except ToolFailed as exc:
            print("failed:", exc)
        print(await record(7))
        """
    )
    result = await answered_at_once(cm, code)
    assert not result.is_error and text_of(result) == "failed: Flaky was cancelled\n7"


async def test_the_program_speaks_utf8_whatever_the_server_locale(tmp_path: Path) -> None:
    """Its output is read as UTF-8: the child runs in UTF-8 mode, since ``-I`` ignores
    ``PYTHONIOENCODING`` and a latin-1 locale would otherwise decide how non-ASCII text is written."""
    code = program(
        """
        import sys
        print(sys.flags.utf8_mode, sys.stdout.encoding, "naïve 中文 ✓")
        """
    )
    result = await run_direct(CodeMode([], cwd=tmp_path), code, timeout=10)
    assert not result.is_error and text_of(result).strip() == "1 utf-8 naïve 中文 ✓"
