"""A small MCP server for the tests, on the official SDK: ``python mcp_server.py [stdio|http PORT]``.

``crash`` ends the server process mid-call, so a test can watch a server die and come back.
"""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer
from pydantic import BaseModel

app = MCPServer("fake")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def fail(why: str) -> str:
    """Always fails, with the reason given."""
    raise ValueError(why)


@app.tool()
async def nap(seconds: float) -> str:
    """Sleep, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@app.tool()
def crash() -> str:
    """End the server process."""
    os._exit(3)


class Forecast(BaseModel):
    city: str
    celsius: float
    days: list[str]


@app.tool()
def forecast(city: str) -> Forecast:
    """Tomorrow's weather (structured output)."""
    return Forecast(city=city, celsius=21.5, days=["mon", "tue"])


@app.tool()
def whoami() -> str:
    """The process id of this server."""
    return str(os.getpid())


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
