"""A process works in its own directory; what ``spawn`` accepts is checked before anything is stored."""

from __future__ import annotations

import pytest

from agentloop import Kernel, Reply, ScriptedModel, ToolResultMessage, call


def _results(messages: list) -> list[str]:
    return [m.text for m in messages if isinstance(m, ToolResultMessage)]


async def test_built_in_tools_of_a_process_work_in_its_cwd(tmp_path):
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "only_in_sub.txt").write_text("from sub\n")
    (ws / "top.txt").write_text("from top\n")
    model = ScriptedModel(
        [
            Reply(tool_calls=[call("Read", path="only_in_sub.txt"), call("Shell", command="pwd")]),
            "done",
            Reply(tool_calls=[call("Read", path="top.txt")]),
            "done",
        ]
    )
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=ws, policy={"default": "auto"}) as k:
        sub = await k.spawn(owner="ann", cwd="sub")  # relative: taken from the workspace
        assert (await sub.info()).cwd == str((ws / "sub").resolve())
        await sub.send("look")
        await sub.wait_idle()
        read, pwd = _results(await sub.messages())
        assert "from sub" in read
        assert pwd.strip().splitlines()[0] == str((ws / "sub").resolve())

        top = await k.spawn(owner="ann")  # the workspace itself: the shared tools
        await top.send("look")
        await top.wait_idle()
        assert "from top" in _results(await top.messages())[0]


async def test_spawn_refuses_a_missing_cwd_and_unsafe_names_before_storing_anything(tmp_path):
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(["x"]), workspace=tmp_path) as k:
        with pytest.raises(ValueError, match="not a directory"):
            await k.spawn(owner="ann", cwd="/nonexistent/place")
        with pytest.raises(ValueError, match="invalid owner"):
            await k.spawn(owner="../../evil")
        with pytest.raises(ValueError, match="invalid run_as"):
            await k.spawn(owner="ann", run_as="a/b")
        with pytest.raises(ValueError, match="invalid pid"):
            await k.spawn(owner="ann", pid="../x")
        assert await k.processes() == []
        ok = await k.spawn(owner="ann@example.com")  # account names may look like addresses
        await ok.kill()
