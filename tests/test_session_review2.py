"""Review of the session 6c38765..HEAD: failing tests that demonstrate defects found.

Each test is named after the defect; its docstring says what is wrong and why it matters. They
are meant to fail until the defect is fixed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from agentloop import ScriptedModel
from agentloop.kernel import Kernel
from agentloop.kernel.account_model import AccountModels
from agentloop.models.gguf_assets import is_path_id
from agentloop.models.registry import names_a_file
from tests import server_support
from tests.server_support import LiveServer

server = server_support.module_server("session-review2")
alice = server_support.alice


# ------------------------------------------------------------------ per-process model


async def test_refused_model_choices_are_cached_for_ever_so_any_api_user_can_grow_server_memory(
    server: LiveServer, alice: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AccountModels.check`` (kernel/account_model.py) builds the model with ``self._model(spec)``
    *before* it checks whether the hosted provider has a key, and ``_model`` keeps every model it
    built in ``self._models`` for ever (no bound, no eviction). So each ``POST …/model`` (or a
    spawn with ``model``) naming a new ``provider:model`` string leaves a model object (and its
    1 KiB spec) in the server's memory, even when the request is refused with a 400. Any account
    with a token can send millions of distinct specs: unbounded memory growth of the server
    (the sibling map ``_choices`` is capped at 4096; this one is not)."""
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    pid = (await alice.post("/v1/processes", json={})).json()["pid"]
    assert server.ctx is not None
    models: AccountModels = server.ctx.kernel.models
    before = len(models._models)
    for n in range(200):
        resp = await alice.post(f"/v1/processes/{pid}/model", json={"model": f"openai:junk-{n}-" + "x" * 900})
        assert resp.status_code == 400, resp.text  # refused: the server has no OpenAI key
    grown = len(models._models) - before
    assert grown == 0, f"{grown} refused model choices are still held in the server's memory"


async def test_an_unknown_local_model_is_accepted_as_a_process_model_and_every_run_then_fails(
    tmp_path: Path,
) -> None:
    """``Process.set_model`` / ``Kernel.spawn(model=)`` promise that "one that cannot be used
    (``AccountModels.check``) is a ``ValueError``, and the choice stays what it was" (and the
    HTTP route a 400). ``check`` only constructs the model: ``LocalModel(model_id)`` accepts any
    id and fails only when it loads. So ``local:no-such-model`` is stored, ``model()`` reports it
    as the effective model with source ``process``, and every later run of the conversation
    fails with "unknown local model" until someone notices and changes it back."""
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(lambda r: "kernel"), workspace=tmp_path, data_dir=tmp_path
    ) as k:
        proc = await k.spawn(owner="alice")
        try:
            await proc.set_model("local:no-such-model")
        except ValueError:
            return  # the fixed behaviour
        await proc.send("hi")
        await proc.wait_idle()
        last = (await proc.messages())[-1]
        pytest.fail(
            "local:no-such-model was accepted as the process's model; its next run ended with: " + last.text[:160]
        )


@pytest.mark.parametrize("model_id", [".env", ".secrets"])
def test_names_a_file_misses_local_model_ids_that_the_local_provider_reads_as_paths(model_id: str) -> None:
    """The API refuses a model choice that "names a file on the server" (``names_a_file``: "only
    its operator may name those"). It only looks for ``/``, ``\\`` and a ``.gguf`` suffix, but the
    local provider (``gguf_assets.is_path_id``) also takes an id starting with ``.`` or ``~`` as a
    path, resolved against the server's working directory: ``local:.env`` passes the API's check
    and makes ``ensure_model_file`` open ``./.env`` as GGUF weights on the next run (a file
    existence oracle through the run's error, and a server file handed to the GGUF parser)."""
    assert is_path_id(model_id)  # what the local provider will do with it: open it as a file
    assert names_a_file(f"local:{model_id}"), f"local:{model_id} is read as a path but not refused over the API"


async def test_http_accepts_a_local_model_that_is_a_dotfile_of_the_servers_working_directory(
    alice: httpx.AsyncClient,
) -> None:
    """End to end for the test above: ``POST /v1/processes/{pid}/model`` with ``local:.env`` is
    answered 200 (stored as the process's model) instead of 400 like ``local:/models/any.gguf``."""
    pid = (await alice.post("/v1/processes", json={})).json()["pid"]
    resp = await alice.post(f"/v1/processes/{pid}/model", json={"model": "local:.env"})
    assert resp.status_code == 400, f"accepted: {resp.status_code} {resp.text}"


# ------------------------------------------------------------------ Discord catch-up

from tests.test_channel_discord import (  # noqa: E402
    ALICE,
    BOT,
    GENERAL,
    GUILD,
    MALLORY,
    FakeDiscord,
    fake,  # noqa: F401  (the fixture)
    running,
    until,
    user_texts,
)


async def test_discord_catch_up_takes_every_server_channel_message_as_if_it_were_a_dm(
    tmp_path: Path,
    fake: FakeDiscord,  # noqa: F811
) -> None:
    """``DiscordBridge._on_message`` tells a server channel from a DM by ``message["guild_id"]``
    and, in a server channel, takes only messages that mention the bot. But ``guild_id`` is one of
    the *extra fields of the gateway's MESSAGE_CREATE event*; the REST message objects that
    ``_catch_up`` reads (``GET /channels/<id>/messages``) have no ``guild_id``. So after a restart
    (or any new gateway session) every message said in a known server channel while the bridge
    was away is treated as addressed to the bot: each allowed user's chatter becomes a run of the
    agent (its text sent to the model provider, answered in the channel), and everyone else's
    gets "this bot is private" posted into the channel. (The fake serves its history with the
    gateway's ``guild_id``, which is why the module's own catch-up test passes.)"""
    async with running(tmp_path, fake, allow=[ALICE]) as (_, bridge, model):
        first = fake.message(GENERAL, ALICE, f"<@{BOT}> hello", guild=GUILD, mentions=(BOT,))
        await until(lambda: fake.texts(GENERAL))
        await until(lambda: bridge.state.last.get(GENERAL) == int(first["id"]))
    # said in the server channel while the bridge was down, none of it to the bot; stored as
    # Discord's REST API returns messages: without the gateway's guild_id
    fake.message(GENERAL, ALICE, "lunch at noon, anyone?", live=False)
    fake.message(GENERAL, MALLORY, "sure, see you there", live=False)
    last = fake.message(GENERAL, ALICE, f"<@{BOT}> what is 2+2", mentions=(BOT,), live=False)
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (_, bridge, _):
        await until(lambda: bridge.state.last.get(GENERAL) == int(last["id"]))
        await until(lambda: "what is 2+2" in user_texts(model))
        await asyncio.sleep(0.3)
        taken = user_texts(model)
        posted = fake.texts(GENERAL)
    assert "lunch at noon, anyone?" not in taken, f"a message not for the bot became a run: {taken}"
    assert not any("private" in text for text in posted), f"a refusal was posted in the channel: {posted}"


async def test_the_servers_own_model_file_is_not_shown_to_its_clients(tmp_path: Path) -> None:
    """``GET …/model`` says which model a conversation's next run uses; when that is the operator's
    default and it names a file on the server (a scripted model's replies, a local model's
    weights), a client is told the provider only, not the server's path."""
    import json as _json

    from agentloop.kernel import Kernel as _Kernel
    from agentloop.server.auth import Principal
    from agentloop.server.service import ProcessService

    replies = tmp_path / "secret-dir" / "replies.json"
    replies.parent.mkdir()
    replies.write_text(_json.dumps(["ok"]))
    async with _Kernel.open(f"sqlite:///{tmp_path}/a.db", model=f"scripted:{replies}", workspace=tmp_path) as k:
        service = ProcessService(k)
        alice = Principal("alice", False, "t1")
        made = await service.spawn(alice)
        shown = await service.model(alice, made["pid"])
    assert "secret-dir" not in _json.dumps(shown) and "secret-dir" not in _json.dumps(made)
    assert shown["source"] == "default" and shown["effective"].startswith("scripted:")
