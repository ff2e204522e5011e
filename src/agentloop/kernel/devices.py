"""Routing tool calls to devices: the kernel's side of DESIGN §4.

A device is another machine that lends its tools. The kernel does not talk to devices itself: it
sees them through a ``DeviceDirectory`` (who is online for an owner, and a way to call one), which
the server's ``DeviceHub`` implements. Keeping only this small protocol here lets the kernel route
calls without importing the server package.

``device_toolset(directory)`` is a ``ToolsetFn`` for ``Kernel.open(toolset=...)``: each run of a
process owned by X gets

* every built-in routable tool (Read, Write, Edit, Delete, Search, Shell, Fetch) wrapped so that it takes
  a ``target``: ``local`` (the original tool, the server's workspace) or one of X's online devices
  that implements the tool's syscall;
* each of X's online devices' extra tools as ``<device>__<tool>``.

Devices of other accounts never appear, and naming one as a target is an error result. The wrapper
is installed even when no device is online (the ``target`` parameter is then simply not shown), so
a stored call that names a device which has since gone away fails instead of silently running on
the server.

Devices blip (a laptop's lid, a phone changing networks): a call to one of the owner's devices that
is offline right now, but may come back, waits a while for it (the directory's business, reported
through the call's ``progress``, within the call's ``deadline``), and a call of an ``idempotent``
tool whose device dropped while it ran is run again once the device is back.

A call the server's shutdown cuts (waiting for its device, or dropped by the closing hub) never
gets a result: the directory says so (``shut_down``) and the tool waits to be cancelled, which the
runtime's close does next (``agentloop serve`` closes the device hub first). A durable process
thus resumes the call after the restart as any call a shutdown interrupted (an idempotent tool
runs again, another gets the runtime's "interrupted by a restart" error), where a recorded
"the server is shutting down" error would end a call that may never have run, and that the
device could run once it is back. (The call's own timeout still bounds that wait.)
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentloop.process.api import ToolsetFn
from agentloop.process.store import ProcessRecord
from agentloop.tools.base import Tool, ToolArgumentsError, ToolContext, ToolResult, format_validation_error
from agentloop.tools.builtin import SYSCALLS
from agentloop.tools.fetch import DEFAULT_TIMEOUT as FETCH_DEFAULT_TIMEOUT
from agentloop.tools.fetch import MAX_TIMEOUT as FETCH_MAX_TIMEOUT
from agentloop.tools.shell import DEFAULT_TIMEOUT as SHELL_DEFAULT_TIMEOUT
from agentloop.tools.shell import MAX_TIMEOUT as SHELL_MAX_TIMEOUT

__all__ = [
    "DEVICE_SYSCALLS",
    "LOCAL",
    "DeviceDirectory",
    "DeviceInfo",
    "DeviceTool",
    "cut_by_shutdown",
    "describe_devices",
    "device_tool_name",
    "device_toolset",
    "shut_down",
    "split_device_tool",
]

LOCAL = "local"
#: the syscalls a device may implement (the routable built-ins)
DEVICE_SYSCALLS: frozenset[str] = frozenset(SYSCALLS.values())
#: seconds a routed non-shell call may take before it is cancelled on the device
DEFAULT_CALL_TIMEOUT = 60.0
#: extra seconds a routed shell call gets beyond its own timeout, for the device to report it
SHELL_GRACE = 10.0
_SEPARATOR = "__"
#: ``details`` of the result of a device call the server's shutdown cut (``shut_down``)
_SHUT_DOWN = "shut_down"


def shut_down(text: str) -> ToolResult:
    """The result a directory gives a device call the server's shutdown cut, before it ran or while
    it did (``text`` says which): an error to a direct caller; the tools here wait for their
    cancellation instead (the module docstring)."""
    return ToolResult.text(text, is_error=True, details={"device_call": _SHUT_DOWN})


def cut_by_shutdown(result: ToolResult) -> bool:
    """Whether ``result`` is a ``shut_down`` one."""
    return isinstance(result.details, dict) and result.details.get("device_call") == _SHUT_DOWN


async def _unless_shut_down(result: ToolResult) -> ToolResult:
    """``result``, unless the server's shutdown cut the call: then wait for the cancellation the
    runtime's close brings (or the call's own timeout), so no result of it is recorded."""
    if cut_by_shutdown(result):
        await asyncio.get_running_loop().create_future()  # (never set)
    return result


@dataclass(frozen=True, slots=True)
class DeviceTool:
    """An extra tool a device advertises: shown to the model as ``<device>__<name>``."""

    name: str
    description: str
    parameters: dict[str, Any]
    #: the device says running it twice does no harm: a call cut by a disconnect is run again
    idempotent: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "idempotent": self.idempotent,
        }


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One online device, as routing and listings see it."""

    id: str
    owner: str
    implements: tuple[str, ...]
    tools: tuple[DeviceTool, ...] = ()
    connected_at: float = 0.0
    description: str = ""  # the owner's words for it ("my laptop, has the GPU"), shown to the model

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "owner": self.owner,
            "description": self.description,
            "implements": list(self.implements),
            "tools": [t.to_json() for t in self.tools],
            "connected_at": self.connected_at,
        }


class DeviceDirectory(Protocol):
    """What the kernel needs of a device hub."""

    def online(self, owner: str) -> Sequence[DeviceInfo]:
        """The devices of ``owner`` connected right now (never another account's)."""
        ...

    async def call(
        self,
        owner: str,
        device_id: str,
        call: str,
        args: dict[str, Any],
        timeout: float | None,  # noqa: ASYNC109 - the per-call deadline is part of the contract
        *,
        idempotent: bool = False,
        progress: Callable[[Any], None] | None = None,
        deadline: float | None = None,
        not_a_device: str | None = None,
    ) -> ToolResult:
        """Run ``call`` on ``owner``'s device; failures (offline, timeout, disconnect) are error
        results, never exceptions. Cancelling the caller cancels the call on the device.
        ``timeout`` bounds the device's answer to one sending; ``deadline`` (the caller's, in
        event-loop time: ``ToolContext.deadline``) the whole call, waits included.

        A device that is offline, but may connect again, may be waited for a while (told through
        ``progress``, the call's ``ToolContext.update``); a call the device dropped is run again
        after it is back only if ``idempotent``: otherwise it might run twice. ``not_a_device`` is
        the error for a ``device_id`` that is not one of the owner's devices (None: the
        directory's own words). A call the server's shutdown cut is a ``shut_down`` result."""
        ...


def device_tool_name(device_id: str, tool: str) -> str:
    return f"{device_id}{_SEPARATOR}{tool}"


def split_device_tool(name: str) -> tuple[str, str] | None:
    """``("laptop", "screenshot")`` for ``laptop__screenshot``; None for a name without ``__``.

    Device ids cannot contain ``__`` nor end in ``_``, so the first ``__`` is the split point."""
    device, sep, tool = name.partition(_SEPARATOR)
    return (device, tool) if sep and device and tool else None


def describe_devices(devices: Sequence[DeviceInfo]) -> str:
    """The ``{{devices}}`` prompt variable: ``local`` first, then one line per online device."""
    lines = [f"- {LOCAL}: the server's own workspace"]
    for d in sorted(devices, key=lambda d: d.id):
        what = ", ".join(d.implements) or "no syscalls"
        extra = ", ".join(device_tool_name(d.id, t.name) for t in d.tools)
        about = f" ({d.description})" if d.description else ""
        lines.append(f"- {d.id}{about}: {what}" + (f"; tools: {extra}" if extra else ""))
    return "\n".join(lines)


def _call_timeout(syscall: str, args: Mapping[str, Any]) -> float:
    """How long the hub waits for a device's answer: a shell command's (or a fetch's) own limit
    plus a grace for the device to stop it and report, otherwise a fixed limit."""
    limits = {
        "shell.exec": (SHELL_DEFAULT_TIMEOUT, SHELL_MAX_TIMEOUT),
        "net.fetch": (FETCH_DEFAULT_TIMEOUT, FETCH_MAX_TIMEOUT),
    }
    if syscall not in limits:
        return DEFAULT_CALL_TIMEOUT
    default, most = limits[syscall]
    given = args.get("timeout")
    limit = float(given) if isinstance(given, int | float) and given > 0 else default
    return min(limit, most) + SHELL_GRACE


def _target_schema(base: dict[str, Any], targets: Sequence[DeviceInfo]) -> dict[str, Any]:
    schema = copy.deepcopy(base)
    names = [LOCAL, *(d.id for d in targets)]
    listed = "; ".join(f"{d.id} (device)" for d in targets)
    schema.setdefault("properties", {})["target"] = {
        "type": "string",
        "enum": names,
        "default": LOCAL,
        "description": (
            f"Where to run it: '{LOCAL}' (the server's workspace, the default) or an online device: {listed}."
        ),
    }
    return schema


class RoutedTool(Tool):
    """A built-in tool that runs locally or, given ``target=<device>``, on one of the owner's devices."""

    def __init__(
        self, base: Tool, syscall: str, owner: str, targets: Sequence[DeviceInfo], directory: DeviceDirectory
    ) -> None:
        params = _target_schema(base.parameters, targets) if targets else base.parameters
        description = base.description
        if targets:
            description += " Set target to run it on one of your devices instead of the server."
        super().__init__(
            base.name,
            description,
            params,
            timeout=base.timeout,
            sequential=base.sequential,
            idempotent=base.idempotent,
            repeatable=base.repeatable,
        )
        self.base = base
        self.syscall = self.device_syscall = syscall
        self.owner = owner
        self.directory = directory
        self.interruptible = base.interruptible

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        rest = dict(arguments)
        target = rest.pop("target", LOCAL)
        if target is None or target == "":
            target = LOCAL
        if not isinstance(target, str):
            raise ToolArgumentsError(format_validation_error(self.name, [("target", "must be a string")], arguments))
        checked = self.base.validate(rest)
        return checked if target == LOCAL else {**checked, "target": target}

    def keeps_result_of(self, arguments: Mapping[str, Any]) -> bool:
        # a device's answer is its owner's: never kept in the workspace every account shares
        return arguments.get("target", LOCAL) == LOCAL and self.base.keeps_result_of(arguments)

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        target = arguments.get("target", LOCAL)
        if target == LOCAL:
            return await self.base.run(arguments, ctx)
        # Checked now rather than at validation: the list the run started with may be stale. A
        # device of the owner's that is offline for now is left to the directory, which waits for
        # it, and refuses (``not_a_device``) a name that is none of the owner's devices.
        connected = {d.id: d for d in self.directory.online(self.owner)}
        device = connected.get(target)
        if device is not None and self.device_syscall not in device.implements:
            return ToolResult.error(self._not_a_target(target, connected.values()))
        args = {k: v for k, v in arguments.items() if k != "target"}
        result = await self.directory.call(
            self.owner,
            target,
            self.device_syscall,
            args,
            _call_timeout(self.device_syscall, args),
            idempotent=self.idempotent,
            progress=ctx.update,
            deadline=ctx.deadline,
            not_a_device=None if device is not None else self._not_a_target(target, connected.values()),
        )
        return await _unless_shut_down(result)

    def _not_a_target(self, target: str, connected: Iterable[DeviceInfo]) -> str:
        online = sorted(d.id for d in connected if self.device_syscall in d.implements)
        listed = ", ".join(online) or "none"
        return (
            f"Target {target!r} is not one of your online devices that implement {self.device_syscall} "
            f"(online: {listed}); use target '{LOCAL}' or an online device."
        )


def unsafe_schema(schema: Any) -> str | None:
    """Why a device's parameter schema cannot be checked on the server, if it cannot: a reference
    outside the schema (resolving it would make the server fetch a URL the device chose) or
    ``patternProperties`` (regexes run on the server's event loop against names the model picks)."""
    if isinstance(schema, list):
        return next((p for p in map(unsafe_schema, schema) if p), None)
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in ("$ref", "$dynamicRef", "$recursiveRef") and isinstance(value, str) and not value.startswith("#"):
            return f"{key} {value[:100]!r} points outside the schema; only references inside it (#/...) are allowed"
        if key == "patternProperties" and isinstance(value, dict):
            return "patternProperties is not supported; list the properties, or use additionalProperties"
    return next((p for p in map(unsafe_schema, schema.values()) if p), None)


def _device_validator(schema: dict[str, Any]) -> Any:
    """A validator for a device's schema: ``pattern`` is not checked (the keyword only: ``enum``
    or ``const`` data that holds the word is left alone), references resolve inside the schema."""
    from jsonschema import Draft202012Validator
    from jsonschema.validators import extend
    from referencing import Registry

    unchecked = extend(Draft202012Validator, {"pattern": lambda validator, pattern, instance, schema: None})
    return unchecked(schema, registry=Registry())


class DeviceExtraTool(Tool):
    """A device's own tool, ``<device>__<name>``, forwarded as the call ``tool.<name>``.

    Its schema is the device's, checked here on the server's event loop: so its ``$ref`` resolve
    inside it only (nothing is fetched: a URL there would make the server request it), and its
    regex ``pattern`` are left to the device, which checks the arguments again (a crafted
    pattern can take Python's ``re`` exponential time, and every account would wait)."""

    def __init__(self, device: DeviceInfo, spec: DeviceTool, directory: DeviceDirectory) -> None:
        super().__init__(
            device_tool_name(device.id, spec.name),
            spec.description,
            spec.parameters,
            idempotent=spec.idempotent,
            keeps_cut_results=False,  # (its answer is its owner's, the workspace every account's)
        )
        self.device = device.id
        self.owner = device.owner
        self.remote_name = spec.name
        self.directory = directory
        self._validator = _device_validator(spec.parameters)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            found = list(self._validator.iter_errors(arguments))
        except Exception as exc:  # a reference that does not resolve, or the like
            raise ToolArgumentsError(
                f"The arguments of {self.name} cannot be checked: its schema from device {self.device} is broken "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
        errors = sorted(found, key=lambda e: list(e.path))
        if errors:
            pairs = [(".".join(str(p) for p in e.path), e.message) for e in errors]
            raise ToolArgumentsError(format_validation_error(self.name, pairs, arguments))
        return arguments

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        result = await self.directory.call(
            self.owner,
            self.device,
            f"tool.{self.remote_name}",
            dict(arguments),
            DEFAULT_CALL_TIMEOUT,
            idempotent=self.idempotent,
            progress=ctx.update,
            deadline=ctx.deadline,
        )
        return await _unless_shut_down(result)


def device_toolset(directory: DeviceDirectory) -> ToolsetFn:
    """A ``ToolsetFn`` that gives each run its owner's devices (see the module docstring)."""

    def toolset(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        devices = list(directory.online(record.owner))
        devices = [d for d in devices if d.owner == record.owner]  # the directory's promise, enforced
        out: dict[str, Tool] = {}
        for name, tool in shared.items():
            syscall = SYSCALLS.get(name)
            if syscall is None:
                out[name] = tool
                continue
            targets = [d for d in devices if syscall in d.implements]
            out[name] = RoutedTool(tool, syscall, record.owner, targets, directory)
        for device in devices:
            for spec in device.tools:
                name = device_tool_name(device.id, spec.name)
                if name not in out and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
                    out[name] = DeviceExtraTool(device, spec, directory)
        return out

    return toolset
