"""The HTTP server: Starlette apps around the library's ``Agent`` and the durable kernel.

``create_app`` is the stateless ``POST /engine/chat`` alone (a gateway's engine, tokens given as a
list). ``create_server`` is what ``agentloop serve`` runs: ``/engine/chat`` plus the ``/v1``
process API and WebSocket over a kernel, with accounts and tokens in the kernel's store, and the
browser UI at ``/`` (``web.py``).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection

from starlette.applications import Starlette
from starlette.routing import Route

from agentloop.agent import Agent
from agentloop.loop.hooks import maybe_await
from agentloop.server import api, web, ws
from agentloop.server.auth import Principal
from agentloop.server.context import ServerContext
from agentloop.server.devices import DeviceHub
from agentloop.server.engine_chat import DEFAULT_MAX_BODY, AgentFactory, Authorize, EngineChat, Prepare
from agentloop.server.errors import ApiError
from agentloop.server.http_errors import exception_handlers

Tokens = Collection[str] | Callable[[str], bool]
# Fits ``/engine/chat``'s fresh agent to the account calling (``serve`` installs its approval
# policy: ``agentloop.cli.serve``); may be async.
ForCaller = Callable[[Principal, Agent], Awaitable[None] | None]


def token_checker(tokens: Tokens) -> Authorize:
    """A check that says whether a bearer token is allowed.

    A collection is compared in constant time against every entry (no early exit), so response
    timing does not reveal how much of a token matched or which entry came close.
    """
    if callable(tokens):
        return tokens
    if isinstance(tokens, str):  # a str is a collection of one-letter tokens: surely a mistake
        raise TypeError("tokens must be a collection of tokens or a function, not one string")
    allowed = [t.encode() for t in tokens if t]

    def check(candidate: str) -> bool:
        given = candidate.encode()
        found = False
        for token in allowed:
            found |= hmac.compare_digest(given, token)
        return found

    return check


def create_app(
    agent_factory: AgentFactory,
    *,
    tokens: Tokens,
    max_body: int = DEFAULT_MAX_BODY,
) -> Starlette:
    """The stateless app. ``agent_factory()`` gives the agent a request runs (its model, tools and
    rules); ``tokens`` are the accepted bearer tokens, or a function that decides."""
    endpoint = EngineChat(agent_factory, token_checker(tokens), max_body=max_body)
    return Starlette(routes=[Route("/engine/chat", endpoint.handle, methods=["POST"])])


def create_server(ctx: ServerContext, agent_factory: AgentFactory, *, for_caller: ForCaller | None = None) -> Starlette:
    """The full server over ``ctx.kernel``; ``/engine/chat`` runs ``agent_factory()``'s agent and
    accepts any valid account token. ``for_caller(principal, agent)`` then fits each request's
    agent to the account behind its token (the factory is not told who calls), before it runs."""

    async def authorize(token: str) -> bool:
        """A valid account token."""
        return await ctx.accounts.authenticate(token) is not None

    async def admit(token: str) -> None:
        """Within its account's input rate: each request runs the model on the server's keys, like
        a message to a process, so both draw on one budget (see ratelimit.py); a stateless route
        beside the limited one would leave it braking nothing. Counted only for a request found
        well-formed, as a message is: a malformed one (400) runs nothing and costs nothing."""
        who = await ctx.accounts.authenticate(token)
        if who is not None and not who.admin:
            ctx.inputs.take(who.account, ctx.max_inputs_per_minute)  # 429 past the rate

    _share_devices(ctx)
    prepare = None if for_caller is None else _with_principal(ctx, for_caller)
    chat = EngineChat(agent_factory, authorize, max_body=ctx.max_body, admit=admit, prepare=prepare)
    routes = [Route("/engine/chat", chat.handle, methods=["POST"]), *api.routes(ctx), *ws.routes(ctx), *web.routes()]
    # Unknown routes, wrong methods and unexpected failures answer JSON {code, message} too.
    return Starlette(routes=routes, exception_handlers=exception_handlers())


def _with_principal(ctx: ServerContext, for_caller: ForCaller) -> Prepare:
    """``/engine/chat``'s ``prepare``: ``for_caller`` given the principal behind the request's
    token, which ``EngineChat`` knows only as accepted. A token revoked since is refused (401),
    never run without its account's fitting."""

    async def prepare(token: str, agent: Agent) -> None:
        who = await ctx.accounts.authenticate(token)
        if who is None:
            raise ApiError(401, "unauthorized", "Missing or invalid bearer token.")
        await maybe_await(for_caller(who, agent))

    return prepare


def _share_devices(ctx: ServerContext) -> None:
    """Bind the device hub to the kernel from the start, not at its first driver: on a store
    several workers share, a device's presence must reach the owner's account watchers here, and
    its revoking or forgetting close its connection here, whichever worker it was done through
    (the lease manager hears of it, and knows no devices: the hub registers with it)."""
    hub = ctx.devices
    if not isinstance(hub, DeviceHub):
        return
    engine = ctx.kernel.engine
    hub.bind(ctx.accounts.store, engine.hub)
    if engine.leases is not None:
        engine.leases.devices.append(hub.heard)
