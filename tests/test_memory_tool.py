"""The ``memory`` tool: the agent's way to the owner's daily memory files beyond the two days the
prompt shows, and to keep or drop entries itself; only the process owner's memory, only through
files that are what they seem."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Kernel
from agentloop.kernel.memory_tool import memory_tool
from agentloop.models.base import ModelRequest
from agentloop.process.memory import append_daily_memory
from agentloop.tools.base import ToolError, ToolResult

DAY = datetime.date(2026, 3, 4)


def at(day: datetime.date, hour: int = 9) -> datetime.datetime:
    return datetime.datetime.combine(day, datetime.time(hour))


def text(result: ToolResult) -> str:
    return "".join(getattr(b, "text", "") for b in result.content)


async def use(home: Path, **arguments: object) -> str:
    memory = memory_tool(home)
    return text(await memory.run(memory.validate(arguments), None))  # type: ignore[arg-type]


async def test_search_reaches_days_the_prompt_no_longer_shows_newest_first(tmp_path: Path) -> None:
    append_daily_memory(tmp_path, "- The staging database is db2.internal", at(DAY))
    append_daily_memory(tmp_path, "- Alice prefers tabs", at(DAY + datetime.timedelta(days=1)))
    append_daily_memory(tmp_path, "- The staging database moved to db3.internal", at(DAY + datetime.timedelta(days=9)))
    found = await use(tmp_path, action="search", query="STAGING database")
    assert found.index("[2026-03-13]") < found.index("[2026-03-04]") and "db3.internal" in found
    assert "tabs" not in found
    assert "[2026-03-04]" not in await use(tmp_path, action="search", query="staging", limit=1)
    assert await use(tmp_path, action="search", query="kubernetes") == "No memory matches 'kubernetes'."
    listed = await use(tmp_path, action="list")
    assert [line[:10] for line in listed.splitlines()[1:]] == ["2026-03-04", "2026-03-05", "2026-03-13"]
    assert "db2.internal" in await use(tmp_path, action="read", day="2026-03-04")


async def test_remember_and_forget(tmp_path: Path) -> None:
    home = tmp_path / "home" / "alice"  # (not made yet: the first memory makes it)
    answer = await use(home, action="remember", text="The release train leaves on Thursdays.")
    today = datetime.date.today().isoformat()
    assert f"memory/{today}.md" in answer
    day_file = home / "memory" / f"{today}.md"
    assert "### From the agent" in day_file.read_text() and "Thursdays" in day_file.read_text()
    await use(home, action="remember", text="Bob owns the billing service.")
    assert await use(home, action="forget", day=today, text="release train") == f"Forgot 1 entry of {today}."
    kept = day_file.read_text()
    assert "Thursdays" not in kept and "Bob owns the billing service." in kept
    await use(home, action="forget", day=today, text="billing")
    assert not day_file.exists()  # nothing left: no empty file
    assert not [p for p in (home / "memory").iterdir()]  # and no temporary left behind


@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        ({"action": "read", "day": "March 4th"}, "day must be YYYY-MM-DD"),
        ({"action": "read"}, "needs a day"),
        ({"action": "read", "day": "2020-01-01"}, "no memories for 2020-01-01"),
        ({"action": "forget", "day": "2026-03-04", "text": "nothing like it"}, "no entry of 2026-03-04 contains"),
        ({"action": "remember", "text": "  "}, "needs the text"),
        ({"action": "remember", "text": "x" * 5000}, "at most 4000 characters"),
        ({"action": "search"}, "needs a query"),
    ],
)
async def test_bad_requests_are_errors_the_model_can_act_on(
    tmp_path: Path, arguments: dict[str, object], why: str
) -> None:
    append_daily_memory(tmp_path, "- something", at(DAY))
    with pytest.raises(ToolError, match=why):
        await use(tmp_path, **arguments)


async def test_a_linked_memory_folder_or_day_file_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "2026-03-04.md").write_text("### From a secret\n\nthe other account's notes\n")
    home = tmp_path / "home"
    home.mkdir()
    os.symlink(elsewhere, home / "memory")
    with pytest.raises(ToolError, match="cannot be used"):
        await use(home, action="read", day="2026-03-04")
    os.unlink(home / "memory")
    (home / "memory").mkdir()
    os.symlink(elsewhere / "2026-03-04.md", home / "memory" / "2026-03-04.md")
    with pytest.raises(ToolError, match="cannot be used"):
        await use(home, action="read", day="2026-03-04")
    assert await use(home, action="search", query="notes") == "No memory matches 'notes'."  # (a link is no day)


async def test_a_process_remembers_for_its_owner_only_and_the_next_run_sees_it(tmp_path: Path) -> None:
    prompts: list[str] = []

    def brain(r: ModelRequest) -> object:
        prompts.append(r.system_prompt)
        last = r.messages[-1].text
        if last == "remember the port":
            return Reply(tool_calls=[call("memory", action="remember", text="The API listens on port 8443.")])
        if last == "what do you know?":
            return Reply(tool_calls=[call("memory", action="search", query="port")])
        return "noted"

    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain), workspace=tmp_path, tools=[]) as k:
        alice = await k.spawn(owner="alice", text="remember the port")
        await alice.wait_idle()
        await alice.send("and now?")
        await alice.wait_idle()
        bob = await k.spawn(owner="bob", text="what do you know?")
        await bob.wait_idle()
        bob_found = [m.text for m in await bob.messages() if m.role == "toolResult"]
    # alice's first run (two calls) had no memory; her next run's prompt shows it, bob's runs do not
    assert "port 8443" not in prompts[0] and "port 8443" in prompts[2]
    assert len(prompts) == 5 and "port 8443" not in prompts[3]
    assert bob_found == ["No memory matches 'port'."]  # bob's memory is his own
    assert "port 8443" in (tmp_path / "home" / "alice" / "memory" / f"{datetime.date.today()}.md").read_text()
