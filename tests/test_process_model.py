"""The model per process: ``Kernel.spawn(model=...)`` and ``Process.set_model`` pick the model (and
reasoning level) of one conversation's runs, named as in ``model.json`` (``provider:model``), kept
in the process's kv, over its account's ``model.json`` and the kernel's model; a change applies from
the next run; a spec that cannot be used is refused and changes nothing. Over HTTP: ``model`` in the
spawn body and ``/v1/processes/{pid}/model``; in ``agentloop chat``: ``/model``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.cli.main import app
from agentloop.client import AgentloopClient, ClientError
from agentloop.kernel import Kernel, Process
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.models.registry import register_provider
from agentloop.server import api
from tests import server_support, test_prompt_manifest
from tests.server_support import LiveServer

MODELS: dict[str, ScriptedModel] = {}  # model id of the ``pm`` provider -> its (one) model


def _script(name: str):  # type: ignore[no-untyped-def]
    def answer(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, ToolResultMessage):
            return f"{name}: after the tool"
        text = last.text if isinstance(last, UserMessage) else ""
        if text == "wait":
            return Reply(tool_calls=[call("wait_gate")])
        return f"{name}: {text}"

    return answer


def named(model_id: str) -> ScriptedModel:
    """``pm:<id>``: a scripted model answering ``<id>: <text>``, one object per id."""
    if model_id not in MODELS:
        MODELS[model_id] = ScriptedModel(_script(model_id))
    return MODELS[model_id]


register_provider("pm", named)

gate = asyncio.Event()


@tool
async def wait_gate() -> str:
    """Wait until the test opens the gate."""
    await gate.wait()
    return "opened"


def open_kernel(tmp_path: Path) -> Kernel:  # type: ignore[return-value]
    return Kernel.open(  # type: ignore[return-value]
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(_script("kernel")), workspace=tmp_path, tools=[wait_gate]
    )


async def answer(proc: Process, text: str = "hi") -> str:
    await proc.send(text)
    await proc.wait_idle()
    return (await proc.messages())[-1].text


def choose(tmp_path: Path, account: str, choice: object) -> None:
    home = tmp_path / "home" / account
    home.mkdir(parents=True, exist_ok=True)
    (home / "model.json").write_text(json.dumps(choice))


async def test_a_process_spawned_with_a_model_runs_on_it_and_others_keep_the_default(tmp_path: Path) -> None:
    async with open_kernel(tmp_path) as k:
        mine = await k.spawn(owner="alice", model="pm:one")
        other = await k.spawn(owner="alice")
        assert await answer(mine) == "one: hi"
        assert await answer(other) == "kernel: hi"
        choice = await mine.model()
        assert (choice.model, choice.source, choice.effective) == ("pm:one", "process", "pm:one")
        default = await other.model()
        assert (default.model, default.source) == (None, "default")
        # the process's choice wins over the account's model.json, which the others then use
        choose(tmp_path, "alice", {"model": "pm:account"})
        assert await answer(mine) == "one: hi"
        assert await answer(other) == "account: hi"
        assert (await other.model()).source == "account" and (await other.model()).effective == "pm:account"


async def test_a_reasoning_level_goes_with_the_process_model(tmp_path: Path) -> None:
    async with open_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", model="pm:thinker", reasoning="high")
        assert await answer(proc) == "thinker: hi"
        assert MODELS["thinker"].requests[-1].reasoning == "high"
        # a level alone keeps the model the account or kernel gives
        choice = await proc.set_model(None, reasoning="low")
        assert (choice.model, choice.reasoning, choice.source) == (None, "low", "default")
        assert await answer(proc) == "kernel: hi"


async def test_set_model_during_a_run_applies_from_the_next_run(tmp_path: Path) -> None:
    global gate
    gate = asyncio.Event()
    async with open_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", model="pm:before")
        await proc.send("wait")
        async with asyncio.timeout(5):
            while not any(isinstance(m, ToolResultMessage) or m.role == "assistant" for m in await proc.messages()):
                await asyncio.sleep(0.01)
        choice = await proc.set_model("pm:after")
        assert (choice.model, choice.source) == ("pm:after", "process")
        gate.set()
        await proc.wait_idle()
        assert (await proc.messages())[-1].text == "before: after the tool"  # the running run kept its model
        assert await answer(proc) == "after: hi"


async def test_the_choice_survives_a_restart_and_none_returns_to_the_default(tmp_path: Path) -> None:
    async with open_kernel(tmp_path) as k:
        pid = (await k.spawn(owner="alice", model="pm:kept")).pid
    async with open_kernel(tmp_path) as k:
        proc = await k.process(pid)
        assert (await proc.model()).model == "pm:kept"
        assert await answer(proc) == "kept: hi"
        choice = await proc.set_model(None)
        assert (choice.model, choice.reasoning, choice.source) == (None, None, "default")
        assert await answer(proc) == "kernel: hi"
    async with open_kernel(tmp_path) as k:
        assert (await (await k.process(pid)).model()).model is None


@pytest.mark.parametrize(
    ("spec", "reasoning", "why"),
    [
        ("nosuchprovider:m", None, "unknown provider 'nosuchprovider'"),
        ("no-colon", None, "must look like 'provider:model'"),
        ("scripted:/no/such/script.json", None, "cannot read scripted model file"),
        ("openai:gpt-4.1-mini", None, "needs OPENAI_API_KEY"),
        ("pm:x", "extreme", "reasoning"),
        ("pm:\x00", None, "NUL"),
        (5, None, "model"),
    ],
    ids=["unknown-provider", "not-a-spec", "model-fails", "no-api-key", "bad-level", "nul", "not-a-string"],
)
async def test_a_spec_that_cannot_be_used_is_refused_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: object, reasoning: object, why: str
) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    async with open_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", model="pm:good")
        with pytest.raises(ValueError, match=r"model|reasoning") as refused:
            await proc.set_model(spec, reasoning=reasoning)  # type: ignore[arg-type]
        assert why in str(refused.value)
        assert (await proc.model()).model == "pm:good"
        assert await answer(proc) == "good: hi"
        before = len(await k.processes("alice"))
        with pytest.raises(ValueError) as refused:
            await k.spawn(owner="alice", model=spec, reasoning=reasoning)  # type: ignore[arg-type]
        assert why in str(refused.value)
        assert len(await k.processes("alice")) == before  # no process was made


async def test_a_stored_choice_that_can_no_longer_be_made_falls_back(tmp_path: Path) -> None:
    script = tmp_path / "gone.json"
    script.write_text(json.dumps(["from the file"]))
    async with open_kernel(tmp_path) as k:
        pid = (await k.spawn(owner="alice", model=f"scripted:{script}")).pid
    script.unlink()
    async with open_kernel(tmp_path) as k:
        proc = await k.process(pid)
        assert await answer(proc) == "kernel: hi"  # logged, and the default answers
        assert (await proc.model()).source == "default"


# ------------------------------------------------------------------ HTTP and the client


server = server_support.module_server("process-model")
alice = server_support.alice


async def test_http_spawn_and_set_the_model(server: LiveServer, alice: httpx.AsyncClient) -> None:
    resp = await alice.post("/v1/processes", json={"model": "pm:http", "text": "hello"})
    assert resp.status_code == 201, resp.text
    spawned = resp.json()
    api.ProcessOut.model_validate(spawned)
    pid = spawned["pid"]
    assert spawned["model"] == {
        "pid": pid,
        "model": "pm:http",
        "reasoning": None,
        "effective": "pm:http",
        "source": "process",
    }
    async with asyncio.timeout(5):
        while (await alice.get(f"/v1/processes/{pid}")).json()["state"] != "idle":
            await asyncio.sleep(0.01)
    history = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
    assert history[-1]["message"]["content"][0]["text"] == "http: hello"

    got = await alice.get(f"/v1/processes/{pid}/model")
    assert got.status_code == 200 and got.json()["model"] == "pm:http"
    api.ModelOut.model_validate(got.json())
    resp = await alice.post(f"/v1/processes/{pid}/model", json={"model": "pm:patched", "reasoning": "medium"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "pm:patched" and resp.json()["reasoning"] == "medium"
    assert (await alice.get(f"/v1/processes/{pid}")).json()["model"]["model"] == "pm:patched"

    for bad in (
        {"model": "nosuchprovider:m"},
        {"model": "pm:x", "reasoning": "extreme"},
        {"model": 5},
        {"reasoning": "low"},  # model is required (null clears it)
        {"model": "pm:x", "colour": "red"},
        {"model": "scripted:/etc/hostname"},  # a file on the server: only its operator may name one
        {"model": "local:/models/any.gguf"},
    ):
        resp = await alice.post(f"/v1/processes/{pid}/model", json=bad)
        assert resp.status_code == 400 and resp.json()["code"] == "invalid_request", (bad, resp.text)
    assert (await alice.get(f"/v1/processes/{pid}/model")).json()["model"] == "pm:patched"
    resp = await alice.post("/v1/processes", json={"model": "nosuchprovider:m"})
    assert resp.status_code == 400 and "nosuchprovider" in resp.json()["message"]

    async with server.client(server.tokens.bob) as bob:
        assert (await bob.post(f"/v1/processes/{pid}/model", json={"model": "pm:bob"})).status_code == 404
        assert (await bob.get(f"/v1/processes/{pid}/model")).status_code == 404
    assert (await alice.get(f"/v1/processes/{pid}/model")).json()["model"] == "pm:patched"

    resp = await alice.post(f"/v1/processes/{pid}/model", json={"model": None})
    assert resp.status_code == 200 and resp.json()["model"] is None and resp.json()["source"] == "default"


def test_the_openapi_document_has_the_model_routes() -> None:
    paths = api.openapi_document()["paths"]
    assert {"get", "post"} <= set(paths["/v1/processes/{pid}/model"])
    assert "model" in api.SpawnBody.model_fields and "model" in api.ProcessOut.model_fields


async def test_client_methods(server: LiveServer) -> None:
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn(model="pm:client"))["pid"]
        assert (await client.model(pid))["model"] == "pm:client"
        assert (await client.set_model(pid, "pm:other", reasoning="high"))["reasoning"] == "high"
        assert (await client.model(pid))["model"] == "pm:other"
        with pytest.raises(ClientError) as bad:
            await client.set_model(pid, "nosuchprovider:m")
        assert bad.value.status == 400 and bad.value.code == "invalid_request"
        assert (await client.set_model(pid, None))["model"] is None


# ------------------------------------------------------------------ chat


isolated = test_prompt_manifest.isolated  # a config-free environment for the CLI


def test_chat_slash_model_shows_sets_and_clears_it(tmp_path: Path, isolated: None) -> None:
    register_provider("pmchat", lambda model_id: ScriptedModel(_script(f"chat-{model_id}")))
    ws = tmp_path / "ws"
    ws.mkdir()
    stdin = "/model\n/model pm:chosen\nhello\n/model\n/model nosuchprovider:m\n/model default\nagain\n/model\n/help\n"
    result = CliRunner().invoke(
        app, ["chat", "-m", "pmchat:x", "-w", str(ws), "--data", str(tmp_path / "data")], input=stdin
    )
    assert "Traceback" not in result.stderr
    err = " ".join(result.stderr.split())
    assert "(model: pmchat:x, the default)" in err
    assert "(model set: pm:chosen, from the next answer on)" in err
    assert "(model: pm:chosen, this conversation's)" in err
    assert "error: " in err and "unknown provider 'nosuchprovider'" in err
    assert "(model: back to the default, pmchat:x)" in err
    assert err.count("(model: pmchat:x, the default)") == 2
    assert "/model [spec|default]" in err
    out = result.stdout
    assert "chosen: hello" in out and "chat-x: again" in out
    assert result.exit_code == 0  # (the refused /model was followed by a turn that went well)
