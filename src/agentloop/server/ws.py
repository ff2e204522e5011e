"""The ``/v1/ws`` WebSocket endpoint (to be filled in)."""

from __future__ import annotations

from starlette.routing import BaseRoute

from agentloop.server.context import ServerContext


def routes(ctx: ServerContext) -> list[BaseRoute]:
    return []
