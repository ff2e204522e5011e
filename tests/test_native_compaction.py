"""Provider-native compaction (opt-in): the Responses API's ``/v1/responses/compact`` asked for
beside the usual readable summary, its encrypted window kept on the summary message and sent in
the summary's place only to the model that made it; the readable summary everywhere else, and
alone when the endpoint fails. In memory (``Compaction(native=True)``) and in a durable process
(``Kernel(native_compaction=True)``, the config file's ``native_compaction``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent
from agentloop.cli.config import kernel_options, load_settings
from agentloop.kernel import Kernel
from agentloop.loop.compaction import SUMMARY_KIND, Compaction
from agentloop.messages import AssistantMessage, Message, SystemMessage, TextContent, user
from agentloop.models.base import PROVIDER_COMPACTION, ModelRequest
from agentloop.models.openai_responses import OpenAIResponsesModel, responses_info, to_responses_input
from agentloop.process.archive import read_archive
from tests.fakes.openai_responses_server import ResponsesFake, compaction_reply, error, text_reply

LONG = "lorem ipsum dolor sit amet " * 80  # about 540 tokens
SUMMARY = "## Goal\nFinish the parts list.\n## Key facts\npart 0 and part 1 were sent."
HEAD = "Summary of the earlier conversation"


@pytest.fixture(scope="module")
def server() -> Iterator[ResponsesFake]:
    with ResponsesFake() as fake:
        yield fake


@pytest.fixture
def fake(server: ResponsesFake) -> Iterator[ResponsesFake]:
    server.reset()
    yield server
    server.reset()


def small(fake: ResponsesFake, model_id: str = "gpt-4o-mini") -> OpenAIResponsesModel:
    """A model whose window the history below overfills, so a run compacts before its call."""
    info = replace(responses_info(model_id), context_window=2_400, max_output=200)
    return OpenAIResponsesModel(model_id, base_url=fake.base_url, api_key="sk-test", info=info)


def history(parts: int = 4) -> list[Message]:
    out: list[Message] = []
    for i in range(parts):
        out.append(user(f"part {i}: {LONG}"))
        out.append(AssistantMessage(content=[TextContent(text=f"noted part {i}")], provider="x", model="y"))
    return out


def summarised(request: dict[str, Any]) -> bool:
    return "Summarise the conversation above." in str(request["input"])


def compaction_items(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in request["input"] if item.get("type") == "compaction"]


def summary_texts(request: dict[str, Any]) -> list[str]:
    return [i["content"] for i in request["input"] if i.get("role") == "developer" and HEAD in str(i["content"])]


async def test_native_compaction_keeps_the_item_beside_a_readable_summary_and_sends_it_back(
    fake: ResponsesFake,
) -> None:
    fake.push(text_reply(SUMMARY), text_reply("on it"))
    fake.compacts.push(compaction_reply("enc-window-1", users=("part 0 (kept by the provider)",), input=900))
    agent = Agent(small(fake), pieces=[Compaction(native=True, keep_recent_tokens=600)])
    result = await agent.run("and the next part?", history=history())

    [asked] = fake.compacts.requests  # the compact endpoint got the history the summary replaces
    assert asked["model"] == "gpt-4o-mini" and "store" not in asked
    assert [i["content"] for i in asked["input"] if i.get("role") == "user"][:2] == [
        f"part 0: {LONG}",
        f"part 1: {LONG}",
    ]
    head = result.messages[0]
    assert isinstance(head, SystemMessage) and head.kind == SUMMARY_KIND
    assert "Finish the parts list." in head.text  # readable, written by the usual summary call
    kept = head.details[PROVIDER_COMPACTION]
    assert kept["provider"] == "openai-responses" and kept["model"] == "gpt-4o-mini"
    assert kept["items"][0]["content"] == [{"type": "input_text", "text": "part 0 (kept by the provider)"}]
    assert kept["items"][-1] == {"type": "compaction", "id": "cmp_1", "encrypted_content": "enc-window-1"}
    assert result.usage.input >= 900  # the compact call is paid for by the run, as the summary is

    answer = fake.requests[-1]  # the run's own call, after the summary call
    assert not summarised(answer) and summarised(fake.requests[0])
    assert answer["input"][: len(kept["items"])] == kept["items"]  # the window in the summary's place
    assert compaction_items(answer) == [kept["items"][-1]] and summary_texts(answer) == []
    assert result.messages[-1].text == "on it"


def test_another_model_or_provider_is_sent_the_readable_summary() -> None:
    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "enc"}
    details = {PROVIDER_COMPACTION: {"provider": "openai-responses", "model": "gpt-4o-mini", "items": [item]}}
    summary = SystemMessage(content=[TextContent(text=f"{HEAD}.\n\n{SUMMARY}")], kind=SUMMARY_KIND, details=details)
    request = ModelRequest(system_prompt="", messages=[summary, user("go on")])

    same = to_responses_input(request, responses_info("gpt-4o-mini"))
    assert same == [item, {"role": "user", "content": "go on"}]
    for other in (responses_info("gpt-4.1"), replace(responses_info("gpt-4o-mini"), provider="openai")):
        sent = to_responses_input(request, other)
        assert sent[0] == {"role": "developer", "content": summary.text} and "compaction" not in str(sent)


async def test_a_failing_compact_endpoint_leaves_the_usual_summary_and_a_warning(
    fake: ResponsesFake, caplog: pytest.LogCaptureFixture
) -> None:
    fake.push(text_reply(SUMMARY), text_reply("on it"))
    fake.compacts.push(error(404, "Not found: /v1/responses/compact", code="not_found"))
    stale = {"type": "compaction", "id": "cmp_0", "encrypted_content": "enc-older"}
    earlier = SystemMessage(
        content=[TextContent(text=f"{HEAD}.\n\nan older summary")],
        kind=SUMMARY_KIND,
        details={PROVIDER_COMPACTION: {"provider": "openai-responses", "model": "gpt-4o-mini", "items": [stale]}},
    )
    agent = Agent(small(fake), pieces=[Compaction(native=True, keep_recent_tokens=600)])
    with caplog.at_level(logging.WARNING, logger="agentloop.compaction"):
        result = await agent.run("and the next part?", history=[earlier, *history()])

    assert len(fake.compacts.requests) == 1 and compaction_items(fake.compacts.last) == [stale]
    head = result.messages[0]
    assert isinstance(head, SystemMessage) and "Finish the parts list." in head.text
    # (the older summary's item stands for less than this summary does: not rolled forward)
    assert PROVIDER_COMPACTION not in (head.details or {})
    assert any("own compaction failed" in r.getMessage() and "404" in r.getMessage() for r in caplog.records)
    answer = fake.requests[-1]
    assert compaction_items(answer) == [] and summary_texts(answer) == [head.text]


async def test_off_by_default_no_compact_call(fake: ResponsesFake) -> None:
    fake.push(text_reply(SUMMARY), text_reply("on it"))
    agent = Agent(small(fake), pieces=[Compaction(keep_recent_tokens=600)])
    result = await agent.run("and the next part?", history=history())
    head = result.messages[0]
    assert isinstance(head, SystemMessage) and head.kind == SUMMARY_KIND and not head.details
    assert fake.compacts.requests == [] and summary_texts(fake.requests[-1]) == [head.text]
    with pytest.raises(TypeError):
        Compaction(native="yes")  # type: ignore[arg-type]


async def test_a_durable_process_compacts_natively_and_archives_the_readable_summary(
    fake: ResponsesFake, tmp_path: Path
) -> None:
    model = OpenAIResponsesModel("gpt-4o-mini", base_url=fake.base_url, api_key="sk-test")
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, data_dir=tmp_path, tools=[],
        native_compaction=True,
    ) as k:  # fmt: skip
        proc = await k.spawn(owner="alice")
        for i in range(3):
            fake.push(text_reply(f"noted part {i}"))
            await proc.send(f"part {i}: {LONG}")
            await proc.wait_idle()
        fake.push(text_reply(SUMMARY))
        fake.compacts.push(compaction_reply("enc-durable", users=("part 0",)))
        done = await proc.compact()
        assert done.compacted and len(fake.compacts.requests) == 1
        assert "part 0: lorem" in str(fake.compacts.last["input"])

        head = (await proc.messages())[0]
        assert isinstance(head, SystemMessage) and "Finish the parts list." in head.text
        kept = head.details[PROVIDER_COMPACTION]
        assert kept["model"] == "gpt-4o-mini" and kept["items"][-1]["encrypted_content"] == "enc-durable"
        assert "_native_compaction" not in head.details  # (the request itself is not kept)
        path = tmp_path / "var" / "sessions" / "alice" / proc.pid / f"{done.archive}.jsonl.gz"
        header, archived = read_archive(path)
        assert header["meta"]["summary"] == head.text and "enc-durable" not in str(header)
        assert archived[0].text == f"part 0: {LONG}"

        fake.push(text_reply("re: and now?"))
        await proc.send("and now?")
        await proc.wait_idle()
        assert compaction_items(fake.last)[0]["encrypted_content"] == "enc-durable"
        assert summary_texts(fake.last) == []


def test_the_config_file_turns_it_on_for_the_kernel(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("native_compaction = true\n")
    assert kernel_options(load_settings(env={"AGENTLOOP_CONFIG": str(cfg)}))["native_compaction"] is True
    cfg.write_text("")
    assert "native_compaction" not in kernel_options(load_settings(env={"AGENTLOOP_CONFIG": str(cfg)}))


def test_only_the_fields_an_input_item_may_carry_are_kept_to_send_back() -> None:
    """What the compact endpoint returns as output carries fields an input item may not
    (``created_by``, ``status``): the API would refuse every later call of the conversation."""
    from agentloop.models.openai_responses import _as_input_item

    compaction = {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAA", "created_by": "u_1"}
    message = {"type": "message", "id": "msg_1", "role": "user", "status": "completed", "content": [{"x": 1}]}
    assert _as_input_item(compaction) == {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAA"}
    assert _as_input_item(message) == {"type": "message", "role": "user", "content": [{"x": 1}]}
    assert _as_input_item({"type": "other", "a": 1}) == {"type": "other", "a": 1}
