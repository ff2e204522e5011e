"""Credentials in URLs never reach an error message (QA: an MCP server's URL and GEMINI_BASE_URL
were repeated with their passwords and API keys)."""

from __future__ import annotations

import pytest

from agentloop.messages import user
from agentloop.models.anthropic import AnthropicModel
from agentloop.models.base import Model, ModelRequest, ProviderError
from agentloop.models.gemini import GeminiModel
from agentloop.models.openai_chat import OpenAIChatModel
from agentloop.tools.mcp import MCPError, mcp_tools
from agentloop.urls import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://bob:hunter2@h:1/mcp?api_key=SECRET&x=1", "http://bob:***@h:1/mcp?api_key=***&x=1"),
        ("https://h/p?access_token=T&X-Amz-Signature=S", "https://h/p?access_token=***&X-Amz-Signature=***"),
        ("https://h/p?page=2", "https://h/p?page=2"),
        ("http://bob@h/", "http://bob@h/"),
        ("postgresql:///db?host=/tmp&password=pw", "postgresql:///db?host=/tmp&password=***"),
        ("http://[::1", "<a URL that cannot be parsed>"),
    ],
)
def test_redact_url_masks_passwords_and_key_like_parameters(url, shown):
    assert redact_url(url) == shown


async def test_an_mcp_servers_url_is_shown_without_its_credentials():
    with pytest.raises(MCPError) as info:
        async with mcp_tools([{"name": "x", "url": "http://bob:hunter2@127.0.0.1:1/mcp?api_key=SECRETKEY"}]):
            pass
    assert "hunter2" not in str(info.value) and "SECRETKEY" not in str(info.value)
    assert "http://bob:***@127.0.0.1:1/mcp?api_key=***" in str(info.value)


def test_geminis_base_url_is_shown_without_its_credentials():
    model = GeminiModel("gemini-2.5-flash", api_key="k", base_url="http://bob:pw@127.0.0.1:1")
    import httpx

    error = model.classify(httpx.ConnectError("refused"))
    assert isinstance(error, ProviderError) and ":pw@" not in str(error) and "bob:***@" in str(error)
    assert ":pw@" not in repr(model)


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini"])
async def test_a_provider_that_cannot_be_reached_is_named_without_its_credentials(provider: str) -> None:
    """The error is stored in the process's history and sent to its watchers: every account using
    the server would see the server's proxy password or key."""
    url = "http://proxy:hunter2@127.0.0.1:9/v1?api_key=SECRETKEY"
    model: Model
    if provider == "openai":
        model = OpenAIChatModel("gpt-4o-mini", api_key="k", base_url=url)
    elif provider == "anthropic":
        model = AnthropicModel("claude-haiku-4-5", api_key="k", base_url=url)
    else:
        model = GeminiModel("gemini-2.5-flash", api_key="k", base_url=url)
    reply = await model.complete(ModelRequest(system_prompt="", messages=[user("hi")], tools=[]))
    shown = reply.error_message or ""
    assert reply.stop_reason == "error" and "cannot reach" in shown
    assert "hunter2" not in shown and "SECRETKEY" not in shown and "proxy:***@127.0.0.1:9" in shown
