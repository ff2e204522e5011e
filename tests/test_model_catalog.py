"""The model catalog (``GET /v1/models``, ``AgentloopClient.models``, ``registry.catalog``): the
models whose facts agentloop knows, each with whether this server can call it and why (or what it
needs), and the server's own model (by its provider only when it names a file on the server)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agentloop.client import AgentloopClient
from agentloop.models.catalog import CATALOG
from agentloop.models.registry import catalog, provider_status
from agentloop.server import api
from tests.server_support import LiveServer, checked, live_server


def test_the_catalog_lists_every_known_model_with_whether_it_can_be_used(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    listed = {m["model"]: m for m in catalog()}
    assert set(listed) == set(CATALOG)
    gpt = listed["openai:gpt-4o"]
    assert gpt["usable"] is False and "OPENAI_API_KEY" in gpt["why"]
    assert gpt["context_window"] == 128_000 and gpt["input_cost"] == 2.5 and gpt["vision"] is True
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert {m["model"]: m for m in catalog()}["openai:gpt-4o"]["usable"] is True
    assert provider_status("local")[0] is True  # the embedded model's package is installed here
    assert provider_status("nope") == (False, "unknown provider")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("catalog")) as srv:
        yield srv


async def test_the_route_needs_a_token_and_answers_the_catalog(server: LiveServer) -> None:
    async with server.client(server.tokens.alice) as alice, server.client("") as nobody:
        answer = checked(await alice.get("/v1/models"), api.ModelCatalog, 200)
        assert (await nobody.get("/v1/models")).status_code == 401
    assert {m["model"] for m in answer["models"]} == set(CATALOG)
    assert answer["default"] == "scripted:(a file on the server)"  # the operator's path is not shown
    async with AgentloopClient(server.url, token=server.tokens.alice) as client:
        assert (await client.models())["models"] == answer["models"]
