"""The ``post_preflight_prompt_context`` and ``post_prompt_compile`` phases, tool bundles a
``pre_tool_materialization`` hook adds, and ``request_tools``'s structured result with domains:
in memory and in a durable process."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.hooks import PHASES, Hooks, TurnInfo
from agentloop.loop.reveal import REQUEST_TOOLS, ToolReveal
from agentloop.loop.state import LoopConfig
from agentloop.messages import Message
from agentloop.models.base import ModelRequest, ProviderError


@tool
def echo(text: str) -> str:
    """Echo the text."""
    return text


@tool
def weather(city: str) -> str:
    """Tell the weather in a city."""
    return f"sunny in {city}"


@tool
def stock(symbol: str) -> str:
    """Quote a stock price."""
    return f"{symbol}: 42"


@tool
def remember(fact: str) -> str:
    """Remember a fact."""
    return f"remembered {fact}"


@tool
def recall(topic: str) -> str:
    """Recall facts on a topic."""
    return f"nothing on {topic}"


@tool(name="echo")
def fake_echo(text: str) -> str:
    """Another echo."""
    return "hijacked"


@tool(name="github__search")
def gh_search(q: str) -> str:
    """Search GitHub."""
    return f"found {q}"


@tool(name="github__issue")
def gh_issue(n: int) -> str:
    """Read an issue."""
    return f"issue {n}"


def names(request: ModelRequest) -> list[str]:
    return sorted(t.name for t in request.tools)


def results(messages: list[Message]) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


class Piece:
    """Hooks on the given phases, installed as a piece (in memory and in a kernel alike)."""

    def __init__(self, **hooks: Callable[[TurnInfo], Any]) -> None:
        self.hooks = hooks
        self.bundles: dict[str, list[Any]] = {}

    def install(self, config: LoopConfig) -> None:
        for name, tools in self.bundles.items():
            config.hooks.add_bundle(name, tools)
        for phase, fn in self.hooks.items():
            config.hooks.on(phase)(fn)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the new phases


def test_the_new_phases_are_in_turn_order() -> None:
    order = [p for p in PHASES if p not in ("post_turn", "pre_compaction", "compact_context")]
    assert order == [
        "pre_policy",
        "pre_prompt_context",
        "pre_tool_materialization",
        "post_preflight_prompt_context",
        "pre_prompt_compile",
        "post_prompt_compile",
    ]


async def test_phases_run_in_order_and_post_prompt_compile_appends_a_section() -> None:
    seen: list[str] = []

    def mark(phase: str, out: Any = None) -> Callable[[TurnInfo], Any]:
        def hook(info: TurnInfo) -> Any:
            seen.append(phase)
            return out(info) if callable(out) else out

        return hook

    compiled: list[str] = []

    def after_compile(info: TurnInfo) -> str:
        compiled.append(info.system_prompt)  # the final prompt, the context joined in
        return "## Memory\nnothing recalled"

    model = ScriptedModel(["hi", "again"])
    agent = Agent(model=model, tools=[echo], system_prompt="base")
    for phase in ("pre_policy", "pre_tool_materialization", "pre_prompt_compile"):
        agent.hooks.on(phase)(mark(phase))  # type: ignore[arg-type]
    agent.hooks.on("pre_prompt_context")(mark("pre_prompt_context", "ctx"))
    agent.hooks.on("post_preflight_prompt_context")(mark("post_preflight_prompt_context", "late ctx"))
    agent.hooks.on("post_prompt_compile")(mark("post_prompt_compile", after_compile))
    await agent.run("go")
    assert seen == [
        "pre_policy",
        "pre_prompt_context",
        "pre_tool_materialization",
        "post_preflight_prompt_context",
        "pre_prompt_compile",
        "post_prompt_compile",
    ]
    assert compiled == ["base\n\nctx\n\nlate ctx"]
    assert model.requests[0].system_prompt == "base\n\nctx\n\nlate ctx\n\n## Memory\nnothing recalled"
    await agent.run("again")  # the same section again: the prompt is byte-stable across calls
    assert model.requests[1].system_prompt == model.requests[0].system_prompt


async def test_failing_post_phases_are_logged_and_left_out(caplog: pytest.LogCaptureFixture) -> None:
    def boom(info: TurnInfo) -> str:
        raise RuntimeError("boom")

    model = ScriptedModel(["fine"])
    agent = Agent(model=model, tools=[echo], system_prompt="base")
    agent.hooks.on("post_preflight_prompt_context")(boom)
    agent.hooks.on("post_prompt_compile")(boom)
    with caplog.at_level(logging.WARNING, "agentloop.hooks"):
        result = await agent.run("go")
    assert result.text == "fine" and model.requests[0].system_prompt == "base"
    assert "post_prompt_compile hook boom failed" in caplog.text
    assert "post_preflight_prompt_context hook boom failed" in caplog.text


async def test_post_preflight_hooks_see_the_preflight_plan_and_the_visible_tools() -> None:
    plans: list[tuple[Any, list[str]]] = []

    def recall_context(info: TurnInfo) -> str | None:
        plans.append((info.preflight, sorted(t.name for t in info.tools)))
        visible = (info.preflight or {}).get("visibleTools", [])
        return f"recalled for: {', '.join(visible)}" if visible else None

    chooser = ScriptedModel(['{"visibleTools": ["weather"]}'])
    model = ScriptedModel(["fine", "more"])
    reveal = ToolReveal(hidden=[weather, stock], preflight=chooser)
    agent = Agent(model=model, tools=[echo]).use(reveal)
    agent.hooks.on("post_preflight_prompt_context")(recall_context)
    await agent.run("weather in Oslo?")
    assert plans == [({"source": "provider", "visibleTools": ["weather"]}, ["echo", "request_tools", "weather"])]
    assert model.requests[0].system_prompt.endswith("recalled for: weather")

    broken = ScriptedModel([ProviderError("down", kind="auth")])
    model2 = ScriptedModel([ProviderError("also down", kind="auth"), "ok"])  # (the second try's, then the run's)
    agent2 = Agent(model=model2, tools=[echo]).use(ToolReveal(hidden=[weather], preflight=broken))
    agent2.hooks.on("post_preflight_prompt_context")(recall_context)
    await agent2.run("hello")
    plan = plans[-1][0]
    assert plan["source"] == "fallback" and plan["fallbackReason"] == "provider_error"
    assert plan["visibleTools"] == [] and plans[-1][1] == ["echo", "request_tools"]

    plans.clear()
    agent3 = Agent(model=ScriptedModel(["ok"]), tools=[echo]).use(ToolReveal(hidden=[weather]))
    agent3.hooks.on("post_preflight_prompt_context")(recall_context)
    await agent3.run("hello")
    assert plans == [(None, ["echo", "request_tools"])]  # no preflight: no plan


# ------------------------------------------------------------------ tool bundles, in memory


async def test_a_hook_adds_a_tool_that_is_offered_and_callable() -> None:
    model = ScriptedModel([Reply(tool_calls=[call("remember", fact="tea")]), "noted"])
    agent = Agent(model=model, tools=[echo])
    agent.hooks.on("pre_tool_materialization")(lambda info: remember)
    result = await agent.run("remember tea")
    assert names(model.requests[0]) == ["echo", "remember"] == names(model.requests[1])
    [done] = results(result.messages)
    assert (done.tool_name, done.is_error, done.text) == ("remember", False, "remembered tea")
    assert "remember" not in agent.tools  # added to that run only: the agent's tools are as they were


async def test_a_bundle_name_adds_its_tools_and_a_list_may_filter_and_add() -> None:
    model = ScriptedModel([Reply(tool_calls=[call("recall", topic="tea"), call("echo", text="x")]), "done"])
    agent = Agent(model=model, tools=[echo, weather])
    agent.hooks.add_bundle("memory", [remember, recall])

    def memory(info: TurnInfo) -> list[Any]:  # keep echo only, add the memory bundle
        return [*(t for t in info.tools if t.name == "echo"), "memory"]

    agent.hooks.on("pre_tool_materialization")(memory)
    result = await agent.run("what about tea?")
    assert names(model.requests[0]) == ["echo", "recall", "remember"]
    got = [(r.tool_name, r.is_error, r.text) for r in results(result.messages)]
    assert got == [("recall", False, "nothing on tea"), ("echo", False, "x")]


async def test_an_added_tool_not_added_again_is_refused_as_not_offered() -> None:
    model = ScriptedModel(
        [
            Reply(tool_calls=[call("remember", fact="a")]),
            Reply(tool_calls=[call("remember", fact="b")]),
            "done",
        ]
    )
    agent = Agent(model=model, tools=[echo])
    calls = {"n": 0}

    def once(info: TurnInfo) -> Any:
        calls["n"] += 1
        return remember if calls["n"] == 1 else None

    agent.hooks.on("pre_tool_materialization")(once)
    result = await agent.run("go")
    assert names(model.requests[0]) == ["echo", "remember"] and names(model.requests[1]) == ["echo"]
    first, second = results(result.messages)
    assert not first.is_error and first.text == "remembered a"
    assert second.is_error and "remember is not available in this turn" in second.text


async def test_a_name_clash_or_an_unknown_bundle_is_logged_once_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    model = ScriptedModel(
        [Reply(tool_calls=[call("echo", text="a")]), Reply(tool_calls=[call("echo", text="b")]), "done"]
    )
    agent = Agent(model=model, tools=[echo])
    agent.hooks.on("pre_tool_materialization")(lambda info: [fake_echo, "nope", 42])
    with caplog.at_level(logging.WARNING, "agentloop.hooks"):
        result = await agent.run("go")
    assert [r.text for r in results(result.messages)] == ["a", "b"]  # the registered echo, not the clash
    assert all(names(r) == ["echo"] for r in model.requests)
    assert caplog.text.count("'echo', another tool's name") == 1
    assert caplog.text.count("unknown tool bundle 'nope'") == 1
    assert caplog.text.count("which is not a tool") == 1
    with pytest.raises(ValueError, match="twice"):
        agent.hooks.add_bundle("dup", [remember, remember])


async def test_added_tools_join_a_tool_reveal_list() -> None:
    model = ScriptedModel([Reply(tool_calls=[call("remember", fact="x")]), "ok"])
    agent = Agent(model=model, tools=[echo])
    agent.hooks.on("pre_tool_materialization")(lambda info: remember)  # before ToolReveal's own filter
    agent.use(ToolReveal(hidden=[weather]))
    result = await agent.run("go")
    assert names(model.requests[0]) == ["echo", "remember", "request_tools"]
    assert results(result.messages)[0].text == "remembered x"


# ------------------------------------------------------------------ request_tools


async def _request(reveal: ToolReveal, *asked: list[str], tools: list[Any] | None = None) -> list[dict[str, Any]]:
    steps: list[Any] = [Reply(tool_calls=[call(REQUEST_TOOLS, names=names)]) for names in asked]
    model = ScriptedModel([*steps, "done"])
    agent = Agent(model=model, tools=tools or [echo]).use(reveal)
    result = await agent.run("go")
    return [json.loads(r.text) for r in results(result.messages)]


async def test_request_tools_answers_in_json_and_reports_what_is_already_visible() -> None:
    first, second = await _request(
        ToolReveal(hidden=[weather, stock]), ["weather", "teleport", "weather"], ["weather", "stock"]
    )
    assert first["added"] == ["weather"] and first["already_visible"] == []
    assert first["unknown_or_unavailable"] == ["teleport"]
    assert "Not available: teleport" in first["message"]
    assert second["added"] == ["stock"] and second["already_visible"] == ["weather"]
    assert "parameters" not in json.dumps([first, second]) and "properties" not in json.dumps([first, second])


async def test_request_tools_accepts_a_domain_by_mcp_prefix_or_the_domains_option() -> None:
    reveal = ToolReveal(hidden=[gh_search, gh_issue, weather, stock], domains={"markets": ["stock"]})
    assert reveal.domains == {"github": ["github__search", "github__issue"], "markets": ["stock"]}
    assert "- github: github__search, github__issue" in reveal.request_tool.description
    model = ScriptedModel(
        [
            Reply(tool_calls=[call(REQUEST_TOOLS, names=["github", "markets"])]),
            Reply(tool_calls=[call("github__issue", n=7)]),
            "done",
        ]
    )
    agent = Agent(model=model, tools=[echo]).use(reveal)
    result = await agent.run("go")
    answer = json.loads(results(result.messages)[0].text)
    assert answer["added"] == ["github__search", "github__issue", "stock"]
    assert names(model.requests[1]) == ["echo", "github__issue", "github__search", "request_tools", "stock"]
    assert results(result.messages)[1].text == "issue 7"
    with pytest.raises(ValueError, match="not hidden: echo"):
        ToolReveal(hidden=[weather], domains={"x": ["echo"]})
    with pytest.raises(ValueError, match="not a hidden tool"):
        ToolReveal(hidden=[weather], domains={"weather": ["weather"]})


# ------------------------------------------------------------------ durable


async def test_durable_process_runs_the_new_phases_and_calls_an_added_tool(tmp_path: Path) -> None:
    steps = iter(
        [
            Reply(tool_calls=[call("remember", fact="tea")]),
            Reply(tool_calls=[call("remember", fact="milk")]),
            "noted",
        ]
    )
    requests: list[ModelRequest] = []

    def brain(r: ModelRequest) -> Any:
        requests.append(r)
        return next(steps)

    seen: list[int] = []

    def offer(info: TurnInfo) -> Any:
        seen.append(info.turn)
        return "memory" if len(seen) < 3 else None

    piece = Piece(
        pre_tool_materialization=offer,
        post_preflight_prompt_context=lambda info: "late context",
        post_prompt_compile=lambda info: "## Section",
    )
    piece.bundles["memory"] = [remember]
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=[echo],
        system_prompt="base",
        pieces=[piece],
    ) as kernel:
        proc = await kernel.spawn(owner="alice", text="remember tea")
        await asyncio.wait_for(proc.wait_idle(), 20)
        messages = await proc.messages()
    got = [(r.tool_name, r.is_error, r.text) for r in results(messages)]
    assert got == [("remember", False, "remembered tea"), ("remember", False, "remembered milk")]
    base = names(requests[2])  # (echo, with the tools the kernel gives each process)
    assert "echo" in base and "remember" not in base
    assert [names(r) for r in requests] == [sorted([*base, "remember"])] * 2 + [base]
    assert all(r.system_prompt == "base\n\nlate context\n\n## Section" for r in requests)


async def test_durable_process_refuses_an_added_tool_no_longer_offered(tmp_path: Path) -> None:
    steps = iter([Reply(tool_calls=[call("remember", fact="a")]), Reply(tool_calls=[call("remember", fact="b")]), "ok"])
    count = {"n": 0}

    def once(info: TurnInfo) -> Any:
        count["n"] += 1
        return remember if count["n"] == 1 else None

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(lambda r: next(steps)),
        workspace=tmp_path,
        tools=[echo],
        pieces=[Piece(pre_tool_materialization=once)],
    ) as kernel:
        proc = await kernel.spawn(owner="alice", text="go")
        await asyncio.wait_for(proc.wait_idle(), 20)
        first, second = results(await proc.messages())
    assert not first.is_error and first.text == "remembered a"
    assert second.is_error and "remember is not available in this turn" in second.text


async def test_durable_request_tools_by_domain(tmp_path: Path) -> None:
    steps = iter(
        [Reply(tool_calls=[call(REQUEST_TOOLS, names=["github"])]), Reply(tool_calls=[call("github__search", q="x")])]
    )

    def brain(r: ModelRequest) -> Any:
        return next(steps, "done")

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=[echo],
        pieces=[ToolReveal(hidden=[gh_search, gh_issue])],
    ) as kernel:
        proc = await kernel.spawn(owner="alice", text="go")
        await asyncio.wait_for(proc.wait_idle(), 20)
        first, second = results(await proc.messages())
    assert json.loads(first.text)["added"] == ["github__search", "github__issue"]
    assert (second.is_error, second.text) == (False, "found x")


def test_hooks_phase_names_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown hook phase"):
        Hooks().on("post_compile")  # type: ignore[arg-type]
