"""The model per account (kernel/account_model.py): ``home/<account>/model.json`` picks the model,
fallbacks, output budget and temperature of that account's runs; other accounts keep the kernel's;
a change applies from the next run; a file that is wrong is logged and changes nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import Kernel
from agentloop.models.base import ProviderError


def script(tmp_path: Path, name: str, replies: list[object]) -> str:
    """A ``scripted:`` model spec answering ``replies`` in turn."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(replies))
    return f"scripted:{path}"


def choose(tmp_path: Path, account: str, choice: object) -> None:
    home = tmp_path / "home" / account
    home.mkdir(parents=True, exist_ok=True)
    (home / "model.json").write_text(choice if isinstance(choice, str) else json.dumps(choice))


async def answer(kernel: Kernel, owner: str, text: str = "hi") -> str:
    proc = await kernel.spawn(owner=owner)
    await proc.send(text)
    await proc.wait_idle()
    return (await proc.messages())[-1].text


async def test_an_accounts_model_file_picks_the_model_of_its_runs_only(tmp_path):
    default = ScriptedModel(lambda r: "from the kernel's model")
    choose(tmp_path, "alice", {"model": script(tmp_path, "alice", ["alice's model, 1", "alice's model, 2"])})
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=default, workspace=tmp_path, tools=[]) as k:
        assert await answer(k, "alice") == "alice's model, 1"
        assert await answer(k, "bob") == "from the kernel's model"
        assert await answer(k, "alice") == "alice's model, 2"  # the same model object: its script goes on
        # a changed file applies from the next run
        choose(tmp_path, "alice", {"model": script(tmp_path, "other", ["another model"]), "max_tokens": 123})
        assert await answer(k, "alice") == "another model"
        (tmp_path / "home" / "alice" / "model.json").unlink()  # gone: the kernel's again
        assert await answer(k, "alice") == "from the kernel's model"


async def test_fallbacks_output_budget_and_temperature_come_from_the_file(tmp_path):
    failing = ScriptedModel([ProviderError("down", kind="auth")])  # not retryable: straight to the fallback
    backup = tmp_path / "backup.json"
    backup.write_text(json.dumps(["from the account's fallback"]))
    choose(tmp_path, "alice", {"fallbacks": [f"scripted:{backup}"], "max_tokens": 321, "temperature": 0.5})
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=failing, workspace=tmp_path, tools=[]) as k:
        assert await answer(k, "alice") == "from the account's fallback"
    assert failing.requests[0].max_tokens == 321 and failing.requests[0].temperature == 0.5


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{not json", "Expecting property name"),
        ({"model": "scripted:x", "colour": "red"}, "colour: Extra inputs are not permitted"),
        ({"max_tokens": 0}, "max_tokens: Input should be greater than 0"),
        ({"model": "nosuchprovider:m"}, "nosuchprovider"),
        ({"model": "scripted:/no/such/script.json"}, "cannot read scripted model file"),
        ([1, 2], "Input should be a valid dictionary"),
    ],
    ids=["not-json", "unknown-field", "bad-budget", "unknown-provider", "model-fails", "not-an-object"],
)
async def test_a_wrong_model_file_is_logged_and_the_kernels_model_answers(tmp_path, caplog, content, why):
    choose(tmp_path, "alice", content)
    default = ScriptedModel(lambda r: "from the kernel's model")
    with caplog.at_level(logging.WARNING, logger="agentloop.kernel.model"):
        async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=default, workspace=tmp_path, tools=[]) as k:
            assert await answer(k, "alice") == "from the kernel's model"
            assert await answer(k, "alice") == "from the kernel's model"
            warnings = [r.getMessage() for r in caplog.records if r.name == "agentloop.kernel.model"]
            assert len(warnings) == 1 and why in warnings[0] and "'alice'" in warnings[0]  # once, not per run
            choose(tmp_path, "alice", {"model": script(tmp_path, "fixed", ["fixed now, a little longer"])})
            assert await answer(k, "alice") == "fixed now, a little longer"  # the fix applies at once
