"""The HTTP server: a Starlette app around the library's ``Agent``.

Only ``POST /engine/chat`` exists so far; the ``/v1`` process API mounts here later. The app
holds an agent factory rather than an agent so every request can get fresh configuration (or
one shared agent: runs never share conversation state either way).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection

from starlette.applications import Starlette
from starlette.routing import Route

from agentloop.server.engine_chat import DEFAULT_MAX_BODY, AgentFactory, Authorize, EngineChat

Tokens = Collection[str] | Callable[[str], bool]


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
    """The server app. ``agent_factory()`` gives the agent a request runs (its model, tools and
    rules); ``tokens`` are the accepted bearer tokens, or a function that decides."""
    endpoint = EngineChat(agent_factory, token_checker(tokens), max_body=max_body)
    return Starlette(routes=[Route("/engine/chat", endpoint.handle, methods=["POST"])])
