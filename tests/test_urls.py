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
from agentloop.urls import redact_secrets, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://bob:hunter2@h:1/mcp?api_key=SECRET&x=1", "http://bob:***@h:1/mcp?api_key=***&x=1"),
        ("https://h/p?access_token=T&X-Amz-Signature=S", "https://h/p?access_token=***&X-Amz-Signature=***"),
        ("https://h/p?page=2", "https://h/p?page=2"),
        ("http://bob@h/", "http://bob@h/"),
        ("postgresql:///db?host=/tmp&password=pw", "postgresql:///db?host=/tmp&password=***"),
        ("http://[::1", "<a URL that cannot be parsed>"),
        ("https://ghp_0123456789abcdefghij0123@github.com/o/r", "https://***@github.com/o/r"),
        ("https://h/p?design=flat&sessionId=9", "https://h/p?design=flat&sessionId=***"),
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


@pytest.mark.parametrize(
    ("text", "hidden", "kept"),
    [
        ("HTTP 401: Incorrect API key provided: sk-e2e-test-key-0000.", "sk-e2e-test-key-0000", "Incorrect API key"),
        ("cannot reach https://bob:pw@llm.internal/v1?api_key=abc: ConnectError", "pw@", "llm.internal/v1"),
        ("cannot reach https://bob:pw@llm.internal/v1?api_key=abc: ConnectError", "api_key=abc", "ConnectError"),
        ('{"error": {"authorization": "Bearer abc.def"}}', "abc.def", '"authorization": '),
        ("token=0123abc; retry later", "0123abc", "retry later"),
        ("key AIzaSyA1234567890abcdefghijklmnopq invalid", "AIzaSyA1234567890", "invalid"),
        ("signature a8f5f167f44f4964e6c998dee827110c0b7c1a3e rejected", "a8f5f167f44f", "rejected"),
        ("rate limited: 429 Too Many Requests", "", "rate limited: 429 Too Many Requests"),
    ],
)
def test_credentials_in_an_error_text_are_masked_and_the_rest_kept(text: str, hidden: str, kept: str) -> None:
    shown = redact_secrets(text)
    assert kept in shown and (not hidden or hidden not in shown)


async def test_a_provider_error_quoting_a_key_is_stored_and_streamed_without_it(tmp_path) -> None:
    """A provider's error reaches the process's history and its signals, which its owner (on a
    server, not the operator whose key it is) reads: the key and the URL's password are masked."""
    from agentloop import ScriptedModel
    from tests.process_support import kernel

    error = "HTTP 401: Incorrect API key provided: sk-live-0123456789 (https://ops:hunter2@llm.internal/v1)"
    async with kernel(tmp_path, ScriptedModel([ProviderError(error, kind="auth")])) as k:
        proc = await k.spawn(owner="bob")
        await proc.send("hi")
        await proc.wait_idle()
        stored = repr([m.message for m in await k.store.history(proc.pid)])
        logged = repr([s.payload async for s in proc.signals(follow=False)])
    for text in (stored, logged):
        assert "Incorrect API key provided" in text and "llm.internal" in text
        assert "sk-live-0123456789" not in text and "hunter2" not in text


def test_a_server_that_cannot_be_reached_is_named_without_the_password_in_its_url(tmp_path) -> None:
    """``agentloop ps --server http://bob:hunter2@host``: the error names the server, not the password."""
    from typer.testing import CliRunner

    from agentloop.cli.main import app

    result = CliRunner().invoke(app, ["ps", "--token", "T" * 20, "--server", "http://bob:hunter2@127.0.0.1:9/"])
    assert result.exit_code == 1 and "cannot reach the server at http://bob:***@127.0.0.1:9" in result.stderr
    assert "hunter2" not in result.stderr
