"""A system event's run id may not end as a delegate's reply does (``admission.BOUND_SUFFIX``).

A reset drops, with the conversation it ends, the queued events whose run id ends with
``:reply`` (a delegate's reply belongs to the conversation it was owed to, whichever worker
queued it). A caller's own event under such an id would have been dropped the same way, its
receipt saying it was queued: it is refused up front instead, with a clear error, in the
library and over HTTP and the WebSocket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentloop import Kernel, ScriptedModel
from agentloop.process import admission
from tests.ws_support import KernelServer


async def test_the_kernel_refuses_a_caller_event_with_a_reply_run_id(tmp_path: Path) -> None:
    model = ScriptedModel(lambda req: "ok", keep_requests=False)
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path) as kernel:
        proc = await kernel.spawn(owner="alice")
        with pytest.raises(ValueError, match="delegate replies"):
            await kernel.signal(proc.pid, "the build finished", run_id=f"build-7{admission.BOUND_SUFFIX}")
        assert await proc.history() == []  # nothing delivered, nothing queued
        assert await kernel.store.queue(proc.pid) == []
        # the suffix alone is reserved: the same words elsewhere in an id are fine
        receipt = await kernel.signal(proc.pid, "the build finished", run_id="build-7:reply-to-ci")
        await proc.wait_idle()
        assert receipt.run_id == "build-7:reply-to-ci"
        assert [m.message.role for m in await proc.history()] == ["system", "assistant"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelServer]:
    with KernelServer(tmp_path_factory.mktemp("reply-ids"), ScriptedModel(lambda req: "ok")) as s:
        yield s


def test_the_server_answers_400_to_an_event_with_a_reply_run_id(server: KernelServer) -> None:
    base = server.url.replace("ws://", "http://").removesuffix("/v1/ws")
    headers = {"Authorization": f"Bearer {server.tokens['alice']}"}
    with httpx.Client(base_url=base, headers=headers, timeout=5) as http, server.client("alice") as ws:
        pid = ws.ok("proc.spawn")["pid"]
        refused = http.post(f"/v1/processes/{pid}/events", json={"text": "hello", "run_id": "x:reply"})
        assert refused.status_code == 400, refused.text
        assert ":reply" in refused.text
        assert ws.error("proc.signal", {"pid": pid, "text": "hello", "run_id": "y:reply"}) == "invalid_request"
        assert ws.ok("proc.history", {"pid": pid})["messages"] == []
