"""The HTTP server (optional extra ``agentloop[server]``): ``create_app`` is the stateless
``/engine/chat`` app, ``create_server`` the full server over a kernel."""

from agentloop.server.app import create_app, create_server, token_checker
from agentloop.server.context import ServerContext

__all__ = ["ServerContext", "create_app", "create_server", "token_checker"]
