"""The Fetch tool's allow-list from the config file (``fetch_allow``) and ``Kernel.open``: the
non-public hosts a deployment wants reachable (a dev server on localhost), checked when read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.cli.config import kernel_options, load_settings, read_config_file
from agentloop.kernel import Approval
from agentloop.messages import ToolResultMessage, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.tools.builtin import builtin_tools
from tests import test_tools_fetch
from tests.process_support import kernel
from tests.test_tools_fetch import Site

site = test_tools_fetch.site  # the local web site fixture, under its name here


async def allow_all(process: Any, row: Any) -> Approval:
    return Approval("auto")


def fetching(url: str) -> Any:
    def brain(request: ModelRequest) -> Reply | str:
        last = request.messages[-1]
        if isinstance(last, UserMessage):
            return Reply(tool_calls=[call("Fetch", url=url)])
        assert isinstance(last, ToolResultMessage)
        return ("error: " if last.is_error else "") + last.text

    return brain


@pytest.mark.parametrize(("allow", "reached"), [((), False), (("127.0.0.1",), True)])
async def test_the_kernels_fetch_reaches_what_the_allow_list_names(
    tmp_path: Path,
    site: Site,
    allow: tuple[str, ...],
    reached: bool,
) -> None:
    model = ScriptedModel(fetching(site.url("/text")))
    async with kernel(tmp_path, model, tools=None, fetch_allow=allow, approval=allow_all) as k:
        proc = await k.spawn(owner="alice", text="fetch it")
        await proc.wait_idle()
        answer = (await proc.messages())[-1].text
    assert ("héllo wörld" in answer) is reached, answer
    assert answer.startswith("error: ") is not reached and ("fetch_allow" in answer or reached)


def test_the_config_file_gives_the_allow_list_to_every_command(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('fetch_allow = ["localhost", "10.0.0.0/8"]\n')
    file, warnings = read_config_file(path)
    settings = load_settings(env={"AGENTLOOP_CONFIG": str(path)})
    assert warnings == [] and file.fetch_allow == ("localhost", "10.0.0.0/8")
    assert kernel_options(settings)["fetch_allow"] == ("localhost", "10.0.0.0/8")
    assert "fetch_allow" not in kernel_options(load_settings(env={"AGENTLOOP_CONFIG": str(tmp_path / "none.toml")}))
    [fetch] = [t for t in builtin_tools(tmp_path, fetch_allow=settings.fetch_allow) if t.name == "Fetch"]
    assert fetch.name == "Fetch"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('fetch_allow = "localhost"', "must be a list"),
        ("fetch_allow = [1, 2]", "must be a list"),
        ('fetch_allow = ["local host"]', "not a host name"),
    ],
)
def test_a_bad_allow_list_stops_the_commands_with_a_clear_error(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text + "\n")
    file, _ = read_config_file(path)
    assert file.fetch_allow == ()
    assert problem in file.errors["fetch_allow"] and str(path) in file.errors["fetch_allow"]
