"""One reasoning level (``off``, ``minimal``, ``low``, ``medium``, ``high``, ``xhigh``) for every
provider: set on the ``Agent``, in an account's ``model.json``, in the config file or with
``--reasoning``, and turned into each provider's own setting by its adapter (a model that does not
reason is sent nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentloop import Agent, ScriptedModel, user
from agentloop.cli.config import load_settings, loop_options
from agentloop.cli.main import app
from agentloop.kernel import Kernel
from agentloop.models.anthropic import AnthropicModel
from agentloop.models.base import ModelRequest
from agentloop.models.catalog import model_info
from agentloop.models.gemini import GeminiModel
from agentloop.models.openai_chat import OpenAIChatModel


def request(level: str | None, **kw: object) -> ModelRequest:
    return ModelRequest(system_prompt="", messages=[user("think")], reasoning=level, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model_id", "level", "effort"),
    [
        ("o4-mini", "high", "high"),
        ("o4-mini", "off", "low"),  # o-series models cannot stop thinking: their least
        ("gpt-5", "off", "minimal"),
        ("gpt-5-mini", "medium", "medium"),
        ("gpt-4o-mini", "high", None),  # not a reasoning model: it would refuse the field
        ("o4-mini", None, None),  # no level: the model's own default
    ],
)
def test_openai_gets_a_reasoning_effort(model_id: str, level: str | None, effort: str | None) -> None:
    params = OpenAIChatModel(model_id, api_key="k").build_params(request(level))
    assert params.get("reasoning_effort") == effort


def test_anthropic_gets_a_thinking_budget_that_fits_its_output() -> None:
    model = AnthropicModel("claude-sonnet-4-5", api_key="k", thinking_budget=5000)
    low = model.build_params(request("low", max_tokens=1000))
    assert low["thinking"] == {"type": "enabled", "budget_tokens": 2048} and low["max_tokens"] >= 2048 + 1024
    off = model.build_params(request("off", temperature=0.3))  # the run's level wins over the model's
    assert "thinking" not in off and off["temperature"] == 0.3
    default = model.build_params(request(None))
    assert default["thinking"]["budget_tokens"] == 5000


def test_gemini_gets_a_thinking_budget_and_pro_models_keep_their_least() -> None:
    def budget(model_id: str, level: str) -> object:
        body = GeminiModel(model_id, api_key="k").build_body(request(level))
        return body["generationConfig"]["thinkingConfig"].get("thinkingBudget")

    assert budget("gemini-2.5-flash", "off") == 0
    assert budget("gemini-2.5-pro", "off") == 128  # a Pro model cannot turn thinking off
    assert budget("gemini-2.5-flash", "high") == 24_576


async def test_the_agents_level_reaches_every_model_call_and_a_bad_one_is_refused() -> None:
    model = ScriptedModel(["thought"])
    await Agent(model=model, reasoning="high").run("think hard")
    assert [r.reasoning for r in model.requests] == ["high"]
    with pytest.raises(ValueError, match="reasoning must be one of off, minimal, low, medium, high, xhigh"):
        Agent(model=ScriptedModel(["x"]), reasoning="max")  # type: ignore[arg-type]


async def test_an_accounts_model_file_sets_its_runs_level(tmp_path: Path) -> None:
    model = ScriptedModel(lambda r: "ok")
    for account, choice in (("alice", {"reasoning": "low"}), ("bob", {"reasoning": "max"})):
        (tmp_path / "home" / account).mkdir(parents=True)
        (tmp_path / "home" / account / "model.json").write_text(json.dumps(choice))
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[]) as k:
        for owner in ("alice", "bob"):
            proc = await k.spawn(owner=owner, text="hi")
            await proc.wait_idle()
    assert [r.reasoning for r in model.requests] == ["low", None]  # bob's file does not validate: ignored


def test_the_config_file_and_the_flag_set_the_level(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('reasoning = "medium"\n')
    env = {"AGENTLOOP_CONFIG": str(cfg)}
    settings = load_settings(env=env)
    assert settings.reasoning == "medium" and not settings.errors
    assert loop_options(settings)["reasoning"] == "medium"
    cfg.write_text('reasoning = "extreme"\n')
    assert load_settings(env=env).errors == [
        f"config file {cfg}: reasoning must be one of off, minimal, low, medium, high, xhigh, got 'extreme'"
    ]
    result = CliRunner().invoke(app, ["run", "--reasoning", "lots", "hi"], env=env)
    assert (
        result.exit_code == 2 and "--reasoning must be one of off, minimal, low, medium, high, xhigh" in result.output
    )


@pytest.mark.parametrize(
    ("model_id", "reasons"),
    [("o3", True), ("o1-preview", True), ("gpt-5.1", True), ("gpt-5-chat-latest", False), ("gpt-4.1-nano", False)],
)
def test_openai_reasoning_models_not_listed_are_known_by_their_family(model_id: str, reasons: bool) -> None:
    assert model_info("openai", model_id).reasoning is reasons
