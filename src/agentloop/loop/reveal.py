"""Hidden tools, revealed on demand: keep the model's tool list short until it needs more.

``ToolReveal`` is a piece you add to an agent (``agent.use(ToolReveal(hidden=[...]))``). The hidden
tools are registered but not shown; the model sees a ``request_tools`` tool whose description lists
them by name and summary, and calling it reveals the named tools from the next round on. A visible
tool is never taken away in the middle of a run. The model may also ask for a *domain*, a group of
hidden tools: those of an MCP server by its prefix (``github`` for ``github__search``, ...), or a
group named by the ``domains`` option (``ToolReveal(hidden, domains={"files": ["read", "grep"]})``).
The result is JSON: ``{"added": [...], "already_visible": [...], "unknown_or_unavailable": [...],
"message": ...}`` (tool names; what was asked for that names no hidden tool nor domain is in
``unknown_or_unavailable``), and never holds a tool's schema.

The revealed set is read back from the history (the ``request_tools`` results), so a run that is
resumed from its stored history sees the same tools. A summary compaction that removes those
results keeps the set on the summary message (``details``, from a ``pre_compaction`` hook), where
the same reading finds it, in later runs and after a restart alike; what a run has shown is also
remembered per run, because the history a turn-phase hook sees may not hold those results any more (a
transform-context hook that trims it, a compaction that summarised them). An optional *preflight*
asks a (cheap) model once per run which hidden tools the request will need; if it fails, answers
nonsense or takes longer than ``preflight_timeout``, the run simply starts without extra tools.
Its plan is given to ``post_preflight_prompt_context`` hooks (``TurnInfo.preflight``):
``{"visibleTools": [...], "source": "provider"}``, or ``"source": "fallback"`` with a
``fallbackReason`` (``timeout``, ``provider_error``) when no model answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from agentloop.loop.hooks import TurnInfo
from agentloop.loop.state import LoopConfig
from agentloop.messages import Message, SystemMessage, ToolResultMessage, UserMessage, user
from agentloop.models.base import Model, ModelRequest
from agentloop.models.registry import resolve_model
from agentloop.tools.base import Tool, ToolArgumentsError, ToolContext, ToolLike, ToolResult, as_tool

log = logging.getLogger("agentloop.reveal")

REQUEST_TOOLS = "request_tools"

_PREFLIGHT_PROMPT = (
    "You choose tools for an assistant. Given the user's request and a list of optional tools, answer with "
    'JSON only: {"visibleTools": [names of the optional tools the request will need]}. '
    "Choose none when none is clearly needed."
)

#: seconds a preflight may hold the turn by default, and at most (Pioneer's provider timeout and cap)
DEFAULT_PREFLIGHT_TIMEOUT = 15.0
MAX_PREFLIGHT_TIMEOUT = 60.0


def check_preflight_timeout(value: object) -> float:
    """``value`` as a preflight timeout in seconds, or ``ValueError``/``TypeError``. Bounded above
    because the preflight holds the turn before its first model call: a person is waiting."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"preflight_timeout must be a number of seconds, got {type(value).__name__}")
    if not (0 < value <= MAX_PREFLIGHT_TIMEOUT) or math.isnan(value):
        raise ValueError(f"preflight_timeout must be above 0 and at most {MAX_PREFLIGHT_TIMEOUT:g} s, got {value}")
    return float(value)


def _summary(tool: Tool) -> str:
    first = tool.description.strip().splitlines()[0] if tool.description.strip() else ""
    return f"- {tool.name}: {first}" if first else f"- {tool.name}"


class ToolReveal:
    """Hidden tools plus the ``request_tools`` tool that reveals them; see the module docstring.

    ``preflight_timeout`` (seconds, at most 60) bounds the whole preflight, its second try
    included: a preflight model that hangs would otherwise hold the turn for ever. Past it the
    run starts without extra tools, as after any other preflight failure; ``request_tools`` is
    still there for the model to ask.
    """

    def __init__(
        self,
        hidden: Iterable[ToolLike],
        *,
        preflight: str | Model | None = None,
        preflight_timeout: float = DEFAULT_PREFLIGHT_TIMEOUT,
        domains: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self.hidden: dict[str, Tool] = {t.name: t for t in map(as_tool, hidden)}
        if not self.hidden:
            raise ValueError("ToolReveal needs at least one hidden tool")
        self.domains = _domains(self.hidden, domains or {})
        self.preflight_timeout = check_preflight_timeout(preflight_timeout)
        self.preflight_model = resolve_model(preflight) if preflight is not None else None
        self.conversation_model: Model | None = None  # the second try of a failed preflight (set by install)
        self._preflight: OrderedDict[str, dict[str, Any]] = OrderedDict()  # run id -> the preflight's plan
        self._shown: OrderedDict[str, frozenset[str]] = OrderedDict()  # run id -> hidden tools shown so far
        catalogue = "\n".join(_summary(t) for t in self.hidden.values())
        if self.domains:
            catalogue += "\nDomains (ask for one by name to get all its tools):\n" + "\n".join(
                f"- {d}: {', '.join(tools)}" for d, tools in self.domains.items()
            )
        self.request_tool = _RequestTools(self, catalogue)

    def install(self, config: LoopConfig) -> None:
        """Register the hidden tools and ``request_tools``, and filter each round's tool list."""
        for name in (*self.hidden, REQUEST_TOOLS):
            if name in config.tools:
                raise ValueError(f"tool {name!r} is registered twice")
        config.tools.update(self.hidden)
        config.tools[REQUEST_TOOLS] = self.request_tool
        self.conversation_model = config.model
        config.hooks.on("pre_tool_materialization")(self._materialize)
        config.hooks.on("pre_compaction")(self._carry)

    def request(self, names: list[str], ctx: ToolContext) -> ToolResult:
        """``request_tools``: reveal the hidden tools ``names`` name (tool or domain names)."""
        wanted = list(dict.fromkeys(n.strip() for n in names if isinstance(n, str) and n.strip()))
        found: list[str] = []
        unknown: list[str] = []
        for name in wanted:
            tools = [name] if name in self.hidden else self.domains.get(name)
            if tools:
                found.extend(tools)
            else:
                unknown.append(name)
        found = list(dict.fromkeys(found))
        visible = ctx.offered if ctx.offered is not None else self.hidden.keys()
        shown = self._shown.get(ctx.run_id or "", frozenset())
        already = [n for n in found if n in visible or n in shown]
        added = [n for n in found if n not in already]
        parts = [f"Available from your next step: {', '.join(added)}." if added else "No tool was added."]
        if already:
            parts.append(f"Already available: {', '.join(already)}.")
        if unknown:
            choices = ", ".join([*sorted(self.hidden), *sorted(self.domains)])
            parts.append(f"Not available: {', '.join(unknown)} (choose from: {choices}).")
        body = {"added": added, "already_visible": already, "unknown_or_unavailable": unknown}
        text = json.dumps({**body, "message": " ".join(parts)}, ensure_ascii=False)
        # ``added`` in the details is what the history says is revealed (``revealed``): all of them
        return ToolResult.text(text, details={"added": found, "unknown": unknown, **body})

    def revealed(self, messages: list[Message]) -> set[str]:
        """Hidden tools revealed so far in this history: by ``request_tools`` results, or by what
        a summary carried of the results it replaced."""
        found: set[str] = set()
        for msg in messages:
            found.update(n for n in _added(msg) if isinstance(n, str) and n in self.hidden)
        return found

    def _carry(self, info: TurnInfo) -> dict[str, Any] | None:
        """What a summary keeps of the history it replaces, so that ``revealed`` still finds the
        tools the model was told it has (the history seen here includes any earlier summary)."""
        found = self.revealed(info.messages)
        return {REQUEST_TOOLS: {"added": sorted(found)}} if found else None

    async def _materialize(self, info: TurnInfo) -> list[Any]:
        visible = self.revealed(info.messages)
        if self.preflight_model is not None:
            plan = await self._preflight_choice(info)
            info.preflight = plan
            visible.update(plan["visibleTools"])
        shown = self._shown.get(info.run_id, frozenset())
        visible |= shown  # never take back a tool this run was shown
        if len(visible) > len(shown):
            self._shown[info.run_id] = frozenset(visible)
            self._shown.move_to_end(info.run_id)
            while len(self._shown) > 256:
                self._shown.popitem(last=False)
        if visible >= set(self.hidden):
            return [t for t in info.tools if t.name != REQUEST_TOOLS]
        return [t for t in info.tools if t.name not in self.hidden or t.name in visible]

    async def _preflight_choice(self, info: TurnInfo) -> dict[str, Any]:
        """The preflight's plan for this run (asked once per run): ``visibleTools`` and ``source``."""
        cached = self._preflight.get(info.run_id)
        if cached is not None:
            return cached
        chosen: list[str] = []
        plan: dict[str, Any] = {"source": "fallback", "fallbackReason": "provider_error"}
        assert self.preflight_model is not None
        request_text = next((m.text for m in reversed(info.messages) if isinstance(m, UserMessage)), "")
        candidates = [{"name": t.name, "summary": t.description.strip()[:200]} for t in self.hidden.values()]
        prompt = json.dumps({"request": request_text[:2000], "optionalTools": candidates})
        request = ModelRequest(system_prompt=_PREFLIGHT_PROMPT, messages=[user(prompt)], max_tokens=200)
        models = [self.preflight_model]
        if self.conversation_model is not None and self.conversation_model is not self.preflight_model:
            models.append(self.conversation_model)  # a cheap preflight model that is down: ask once more
        deadline = time.monotonic() + self.preflight_timeout
        for model in models:
            left = deadline - time.monotonic()
            if left <= 0:  # the first try used the time up: no second try, no extra tools
                log.warning("tool preflight: no time left to ask %s, starting without extra tools", model.name)
                plan["fallbackReason"] = "timeout"
                break
            try:
                async with asyncio.timeout(left):
                    answer = await model.complete(request)
            except TimeoutError:  # a hung model: the turn goes on without waiting for it any longer
                log.warning("tool preflight with %s took longer than %g s", model.name, self.preflight_timeout)
                plan["fallbackReason"] = "timeout"
                continue
            except Exception as exc:  # a preflight never fails the turn
                log.warning("tool preflight with %s failed: %s", model.name, exc)
                plan["fallbackReason"] = "provider_error"
                continue
            if answer.stop_reason in ("error", "aborted"):
                log.warning("tool preflight with %s failed: %s", model.name, answer.error_message)
                plan["fallbackReason"] = "provider_error"
                continue
            chosen = _parse_choice(answer.text, set(self.hidden))
            plan = {"source": "provider"}
            break
        else:
            log.warning("tool preflight failed, starting without extra tools")
        plan["visibleTools"] = chosen
        self._preflight[info.run_id] = plan
        while len(self._preflight) > 256:
            self._preflight.popitem(last=False)
        return plan


class _RequestTools(Tool):
    """The ``request_tools`` tool of a ``ToolReveal``: it reads which tools its call was shown."""

    def __init__(self, reveal: ToolReveal, catalogue: str) -> None:
        super().__init__(
            REQUEST_TOOLS,
            "Ask for more tools, by tool name or domain name. They become callable from your next step. "
            "Optional tools:\n" + catalogue,
            {
                "type": "object",
                "properties": {
                    "names": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "Tool names or domain names to add.",
                    },
                    "reason": {"type": "string", "description": "Why they are needed."},
                },
                "required": ["names"],
            },
        )
        self.reveal = reveal

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        names = arguments.get("names")
        if isinstance(names, str):  # one name, not in a list: what was meant is plain
            names = [names]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ToolArgumentsError(f"{REQUEST_TOOLS} needs names: a list of tool or domain names")
        reason = arguments.get("reason", "")
        return {"names": names, "reason": reason if isinstance(reason, str) else str(reason)}

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return self.reveal.request(arguments["names"], ctx)


def _domains(hidden: Mapping[str, Tool], given: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    """Domain name -> its hidden tools: those of each MCP server (``server__tool``) by the
    server's name, then the ``domains`` given (which take precedence). A domain may not be named
    like a hidden tool, nor name a tool that is not hidden."""
    found: dict[str, list[str]] = {}
    for name in hidden:
        server, sep, rest = name.partition("__")
        if sep and server and rest and server not in hidden:
            found.setdefault(server, []).append(name)
    for domain, names in given.items():
        tools = list(dict.fromkeys([names] if isinstance(names, str) else names))
        if not isinstance(domain, str) or not domain or domain in hidden:
            raise ValueError(f"domain {domain!r} must be a name that is not a hidden tool's")
        stray = [n for n in tools if n not in hidden]
        if stray or not tools:
            raise ValueError(f"domain {domain!r} must name hidden tools; not hidden: {', '.join(stray) or '(none)'}")
        found[domain] = tools
    return found


def _added(msg: Message) -> list[Any]:
    """The names a message says were revealed: a ``request_tools`` result's details, or the same
    shape kept under ``request_tools`` in a system message's (a summary's) details."""
    details: Any = None
    if isinstance(msg, ToolResultMessage) and msg.tool_name == REQUEST_TOOLS:
        details = msg.details
    elif isinstance(msg, SystemMessage) and isinstance(msg.details, dict):
        details = msg.details.get(REQUEST_TOOLS)
    added = details.get("added") if isinstance(details, dict) else None
    return added if isinstance(added, list) else []


def _parse_choice(text: str, allowed: set[str]) -> list[str]:
    match = re.search(r"\{.*\}", text, re.DOTALL)
    if not match:
        return []
    try:
        data = json.loads(match.group(0))
    except json.JSONDecodeError:
        return []
    names = data.get("visibleTools") if isinstance(data, dict) else None
    if not isinstance(names, list):
        return []
    return sorted({n.strip() for n in names if isinstance(n, str) and n.strip() in allowed})
