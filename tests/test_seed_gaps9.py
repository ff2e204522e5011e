"""Two gaps against the designs agentloop follows.

1. pi's reasoning levels include ``minimal`` and ``xhigh`` around off/low/medium/high: every place
   that takes a level takes them, and each provider receives its own nearest setting on the wire
   (checked against the local fakes of OpenAI, Anthropic and Gemini, not just the built params).
2. The Agent Loop Spec's gateway names the actor of an ``/engine/chat`` request in ``X-Actor-ID``
   and ``X-Actor-Permissions``: they reach the run's tools read-only, a malformed one is a 400
   before the stream, and they never stand in for the bearer token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from openai.types.shared.reasoning_effort import ReasoningEffort
from typer.testing import CliRunner

from agentloop import Agent, Reply, ScriptedModel, ToolContext, call, tool, user
from agentloop.cli.config import load_settings, loop_options
from agentloop.cli.main import app as cli_app
from agentloop.kernel import Kernel
from agentloop.models.anthropic import AnthropicModel
from agentloop.models.base import REASONING_LEVELS, ModelRequest, check_reasoning
from agentloop.models.gemini import GeminiModel
from agentloop.models.openai_chat import OpenAIChatModel
from agentloop.server import create_app
from tests.fakes import anthropic_server, gemini_server, openai_server
from tests.fakes.anthropic_server import AnthropicFake
from tests.fakes.gemini_server import GeminiFake
from tests.fakes.openai_server import OpenAIFake

# anthropic 2.x warns about model ids it considers deprecated; the ids here are only fixture names
pytestmark = pytest.mark.filterwarnings("ignore:The model .* is deprecated:DeprecationWarning")

ALL_LEVELS = "off, minimal, low, medium, high, xhigh"

# ------------------------------------------------------------------ 1. reasoning levels


def request(level: str, **kw: Any) -> ModelRequest:
    return ModelRequest(system_prompt="", messages=[user("think")], reasoning=level, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def openai_fake() -> Iterator[OpenAIFake]:
    with OpenAIFake() as fake:
        yield fake


@pytest.fixture(scope="module")
def anthropic_fake() -> Iterator[AnthropicFake]:
    with AnthropicFake() as fake:
        yield fake


@pytest.fixture(scope="module")
def gemini_fake() -> Iterator[GeminiFake]:
    with GeminiFake() as fake:
        yield fake


def test_the_levels_are_pis_and_every_validator_lists_them(tmp_path: Path) -> None:
    assert ", ".join(REASONING_LEVELS) == ALL_LEVELS
    assert check_reasoning("minimal") == "minimal" and check_reasoning("xhigh") == "xhigh"
    with pytest.raises(ValueError, match=f"reasoning must be one of {ALL_LEVELS}, got 'max'"):
        Agent(model=ScriptedModel(["x"]), reasoning="max")  # type: ignore[arg-type]

    cfg = tmp_path / "config.toml"
    env = {"AGENTLOOP_CONFIG": str(cfg)}
    for level in ("minimal", "xhigh"):
        cfg.write_text(f'reasoning = "{level}"\n')
        settings = load_settings(env=env)
        assert not settings.errors and loop_options(settings)["reasoning"] == level
    cfg.write_text('reasoning = "ultra"\n')
    assert load_settings(env=env).errors == [f"config file {cfg}: reasoning must be one of {ALL_LEVELS}, got 'ultra'"]

    result = CliRunner().invoke(
        cli_app, ["run", "--reasoning", "ultra", "hi"], env={"AGENTLOOP_CONFIG": "/nonexistent"}
    )
    assert result.exit_code == 2 and f"--reasoning must be one of {ALL_LEVELS}" in result.output
    assert "minimal" in CliRunner().invoke(cli_app, ["run", "--help"], env={"COLUMNS": "200"}).output


async def test_the_new_levels_reach_the_model_from_the_agent_and_an_accounts_model_file(tmp_path: Path) -> None:
    model = ScriptedModel(["ok"])
    await Agent(model=model, reasoning="xhigh").run("think very hard")
    assert [r.reasoning for r in model.requests] == ["xhigh"]

    model = ScriptedModel(lambda r: "ok")
    (tmp_path / "home" / "alice").mkdir(parents=True)
    (tmp_path / "home" / "alice" / "model.json").write_text(json.dumps({"reasoning": "minimal"}))
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[]) as k:
        proc = await k.spawn(owner="alice", text="hi")
        await proc.wait_idle()
    assert [r.reasoning for r in model.requests] == ["minimal"]


@pytest.mark.parametrize(
    ("model_id", "level", "effort"),
    [
        ("o4-mini", "minimal", "low"),  # the o-series takes low, medium, high: the nearest
        ("o4-mini", "xhigh", "high"),
        ("gpt-5", "minimal", "minimal"),
        ("gpt-5-mini", "xhigh", "high"),  # gpt-5 has no xhigh
        ("gpt-5", "off", "minimal"),  # nor none: its least
        ("gpt-5.1", "off", "none"),  # gpt-5.1 can stop thinking but has no minimal...
        ("gpt-5.1", "minimal", "low"),  # ...so minimal goes up, to some thinking, not none
        ("gpt-5.1", "xhigh", "high"),
        ("gpt-5.1-codex-max", "xhigh", "xhigh"),
        ("gpt-5.2", "xhigh", "xhigh"),
        ("gpt-5.2", "minimal", "low"),
        ("gpt-5-pro", "low", "high"),  # thinks at high only
    ],
)
async def test_openai_receives_the_nearest_effort_its_model_takes(
    openai_fake: OpenAIFake, model_id: str, level: str, effort: str
) -> None:
    openai_fake.reset()
    openai_fake.push(openai_server.text_reply("ok"))
    model = OpenAIChatModel(model_id, base_url=openai_fake.base_url, api_key="sk-test")
    events = [e async for e in model.stream(request(level))]
    assert events and openai_fake.last["reasoning_effort"] == effort
    assert effort in get_args(get_args(ReasoningEffort)[0])  # a value the installed SDK's type lists


@pytest.mark.parametrize(
    ("model_id", "level", "budget"),
    [
        ("claude-sonnet-4-5", "minimal", 1_024),  # the least the API takes
        ("claude-sonnet-4-5", "xhigh", 32_000),  # half its 64k output, as every level is held to
        ("claude-opus-4-1", "xhigh", 16_000),  # a 32k output: xhigh is high there
    ],
)
async def test_anthropic_receives_a_budget_within_its_models_limits(
    anthropic_fake: AnthropicFake, model_id: str, level: str, budget: int
) -> None:
    anthropic_fake.reset()
    anthropic_fake.push(anthropic_server.text_reply("ok"))
    model = AnthropicModel(model_id, base_url=anthropic_fake.base_url, api_key="sk-ant-test")
    events = [e async for e in model.stream(request(level, max_tokens=1000))]
    sent = anthropic_fake.last
    assert events and sent["thinking"] == {"type": "enabled", "budget_tokens": budget}
    assert sent["max_tokens"] >= budget + 1024  # the budget must fit in max_tokens


@pytest.mark.parametrize(
    ("model_id", "level", "budget"),
    [
        ("gemini-2.5-flash", "minimal", 1_024),
        ("gemini-2.5-flash", "xhigh", 24_576),  # Flash takes at most 24k: xhigh is its high
        ("gemini-2.5-flash-lite", "xhigh", 24_576),
        ("gemini-2.5-pro", "xhigh", 32_768),  # Pro takes up to 32k
        ("gemini-2.5-pro", "minimal", 1_024),
    ],
)
async def test_gemini_receives_a_budget_within_its_family_range(
    gemini_fake: GeminiFake, model_id: str, level: str, budget: int
) -> None:
    gemini_fake.reset()
    gemini_fake.push(gemini_server.text_reply("ok"))
    model = GeminiModel(model_id, base_url=gemini_fake.base_url, api_key="AIza-test")
    events = [e async for e in model.stream(request(level))]
    assert events and gemini_fake.last["generationConfig"]["thinkingConfig"]["thinkingBudget"] == budget


# ------------------------------------------------------------------ 2. actor headers on /engine/chat

TOKEN = "s3cret-token-value-123"


def chat_body(**meta: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "who am I?"}], "metadata": {"correlation_id": "c-9", **meta}}


def actor_app(seen: list[Any], model_calls: list[Any] | None = None) -> Any:
    @tool
    def whoami(ctx: ToolContext) -> str:
        """Say who the request is for."""
        actor = (ctx.metadata or {}).get("actor")
        seen.append(actor)
        if isinstance(actor, Mapping):
            try:
                actor["permissions"] = ("admin:*",)  # type: ignore[index]
            except TypeError:
                seen.append("read-only")
        return "checked"

    def factory() -> Agent:
        model = ScriptedModel([Reply(tool_calls=[call("whoami")]), "done"])
        if model_calls is not None:
            model_calls.append(model)
        return Agent(model, tools=[whoami])

    return create_app(factory, tokens={TOKEN})


async def post(app: Any, payload: Any, headers: list[tuple[str, str | bytes]]) -> httpx.Response:
    base: list[tuple[str, str | bytes]] = [("content-type", "application/json")]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/engine/chat", content=json.dumps(payload).encode(), headers=base + headers)


def auth(token: str = TOKEN) -> list[tuple[str, str | bytes]]:
    return [("authorization", f"Bearer {token}")]


async def test_a_tool_sees_the_gateways_actor_read_only() -> None:
    seen: list[Any] = []
    headers = [*auth(), ("X-Actor-ID", "owner_abc123"), ("X-Actor-Permissions", "memory:*, tools:*,memory:*")]
    resp = await post(actor_app(seen), chat_body(), headers)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert "event: done" in resp.text
    assert seen == [{"id": "owner_abc123", "permissions": ("memory:*", "tools:*")}, "read-only"]


async def test_an_actor_comes_from_the_headers_only_and_may_have_no_permissions() -> None:
    seen: list[Any] = []
    spoof = chat_body(actor={"id": "root", "permissions": ["*"]})  # the body cannot name an actor
    assert (await post(actor_app(seen), spoof, auth())).status_code == 200
    headers = [*auth(), ("x-actor-id", "owner_1"), ("x-actor-permissions", "")]
    assert (await post(actor_app(seen), chat_body(), headers)).status_code == 200
    assert seen == [None, {"id": "owner_1", "permissions": ()}, "read-only"]


@pytest.mark.parametrize(
    ("actor_headers", "named"),
    [
        ([("X-Actor-ID", "owner abc"), ("X-Actor-Permissions", "tools:*")], "X-Actor-ID"),
        ([("X-Actor-ID", "o" * 257), ("X-Actor-Permissions", "tools:*")], "X-Actor-ID"),
        ([("X-Actor-ID", "own\xe9r".encode("latin-1")), ("X-Actor-Permissions", "tools:*")], "X-Actor-ID"),
        ([("X-Actor-ID", "owner_1"), ("X-Actor-Permissions", "memory:*,,tools:*")], "X-Actor-Permissions"),
        ([("X-Actor-ID", "owner_1"), ("X-Actor-Permissions", "memory read")], "X-Actor-Permissions"),
        ([("X-Actor-ID", "owner_1"), ("X-Actor-Permissions", "p," * 2100)], "X-Actor-Permissions"),
        ([("X-Actor-ID", "owner_1")], "X-Actor-Permissions"),
        ([("X-Actor-Permissions", "tools:*")], "X-Actor-ID"),
        ([("X-Actor-ID", "a"), ("X-Actor-ID", "b"), ("X-Actor-Permissions", "tools:*")], "X-Actor-ID"),
    ],
)
async def test_a_malformed_actor_is_a_400_before_the_stream(
    actor_headers: list[tuple[str, str | bytes]], named: str
) -> None:
    seen: list[Any] = []
    models: list[Any] = []
    resp = await post(actor_app(seen, models), chat_body(), auth() + actor_headers)
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    err = resp.json()
    assert err["code"] == "invalid_request" and err["message"].startswith(f"{named}: ")
    assert "owner" not in err["message"] and "memory" not in err["message"]  # the value is not echoed
    assert models == [] and seen == []  # no run was started


async def test_actor_headers_are_no_credential() -> None:
    seen: list[Any] = []
    gateway = [("X-Actor-ID", "owner_abc123"), ("X-Actor-Permissions", "*")]
    assert (await post(actor_app(seen), chat_body(), gateway)).status_code == 401
    assert (await post(actor_app(seen), chat_body(), auth("wrong") + gateway)).status_code == 401
    malformed = [("X-Actor-ID", "bad id")]  # the token is checked first: no hint about actors to a stranger
    assert (await post(actor_app(seen), chat_body(), auth("wrong") + malformed)).status_code == 401
    assert seen == []
