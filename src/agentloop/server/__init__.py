"""The HTTP server (optional extra ``agentloop[server]``): ``create_app`` builds the ASGI app."""

from agentloop.server.app import create_app, token_checker

__all__ = ["create_app", "token_checker"]
