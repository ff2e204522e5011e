"""Follow-ups of the seventh server review: an event stream outlives a revocation check the store
failed to answer (as a WebSocket does), a refused attachment leaves no file behind, and a title
must show something."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import ScriptedModel
from agentloop.server.auth import Accounts, Principal
from tests.image_support import PNG
from tests.ws_support import KernelServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelServer]:
    model = ScriptedModel(lambda req: "ok", keep_requests=False)
    with KernelServer(tmp_path_factory.mktemp("followups-review7"), model) as s:
        yield s


def _http(server: KernelServer, token: str) -> httpx.Client:
    base = server.url.replace("ws://", "http://").removesuffix("/v1/ws")
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=5)


def _spawn(http: httpx.Client) -> str:
    resp = http.post("/v1/processes", json={})
    assert resp.status_code == 201, resp.text
    pid: str = resp.json()["pid"]
    return pid


# ------------------------------------------------------------------ SSE: a failed revocation check


@pytest.mark.parametrize("stream", ["process", "account"])
def test_an_event_stream_outlives_a_failed_revocation_check(
    server: KernelServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stream: str
) -> None:
    """The store failing to answer the heartbeat's token check (a lost database connection) cut an
    event stream with an error, where a WebSocket logs it and checks again: every SSE client was
    dropped at each database blip. Now the stream goes on, and a token revoked afterwards still
    ends it at the next check."""
    assert server.ctx is not None
    ctx = server.ctx
    token, record = server.run(lambda: ctx.accounts.create_token("alice", label=f"sse-{stream}"))
    original = Accounts.still_valid
    failures = 2

    async def flaky(self: Accounts, who: Principal) -> bool:
        nonlocal failures
        if who.token_id == record.id and failures:
            failures -= 1
            raise ConnectionError("the database server is unreachable")
        valid: bool = await original(self, who)
        return valid

    monkeypatch.setattr(Accounts, "still_valid", flaky)
    monkeypatch.setattr(ctx, "heartbeat", 0.05)
    caplog.set_level(logging.WARNING, logger="agentloop.server")
    with _http(server, token) as http:
        path = f"/v1/processes/{_spawn(http)}/events" if stream == "process" else "/v1/events"
        pings_after_failures, revoked, cut = 0, False, False
        with http.stream("GET", path) as resp:
            assert resp.status_code == 200, resp.read()
            try:
                for line in resp.iter_lines():
                    if line != ": ping" or failures:
                        continue
                    pings_after_failures += 1
                    if pings_after_failures == 3:
                        server.run(lambda: ctx.accounts.revoke(record.id))
                        revoked = True
                    assert pings_after_failures < 100, "the revoked token did not end the stream"
            except httpx.RemoteProtocolError:  # the server gave up on the response half-way
                cut = True
        assert not cut, "the stream was cut by a failed check"
        assert failures == 0 and revoked and pings_after_failures >= 3
        assert http.get(path).status_code == 401
    logged = [r.getMessage() for r in caplog.records if "token check failed" in r.getMessage()]
    assert len(logged) == 2, logged
    assert all(token not in text and "alice" in text for text in logged)


# ------------------------------------------------------------------ refused media


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


GOOD = {"data": _b64(PNG), "mime_type": "image/png"}
REFUSED = {
    "nul": ({"data": _b64(b"a\x00b"), "mime_type": "text/plain"}, 400),
    "not-pdf": ({"data": _b64(b"plain words"), "mime_type": "application/pdf"}, 400),
    "too-large": ({"data": _b64(b"x" * (300 * 1024)), "mime_type": "text/plain"}, 413),
}


def _media_files(root: Path) -> list[Path]:
    media = root / "var" / "media"
    return sorted(p for p in media.rglob("*") if p.is_file()) if media.exists() else []


def test_a_refused_attachment_leaves_no_file_of_its_message(server: KernelServer) -> None:
    """A message, or a spawn's first one, whose later attachment is refused (NUL bytes in a text
    document, a "PDF" without its header, a document over the size limit) is answered 4xx, and
    the good attachment before it is not left on disk: every attachment is checked before any
    is written (``kernel._user_input``), over HTTP and the WebSocket alike."""
    root = server.tmp_path
    with _http(server, server.tokens["bob"]) as http, server.client("bob") as ws:
        pid = _spawn(http)
        assert _media_files(root) == []
        for name, (bad, status) in REFUSED.items():
            media = [GOOD, bad]
            resp = http.post(f"/v1/processes/{pid}/messages", json={"text": name, "media": media})
            assert resp.status_code == status and resp.json()["message"].startswith("media:"), resp.text
            res = ws.call("proc.send", {"pid": pid, "text": name, "media": media})
            assert not res["ok"] and res["error"]["message"].startswith("media:"), res
            resp = http.post("/v1/processes", json={"text": name, "media": media})
            assert resp.status_code == status and resp.json()["message"].startswith("media:"), resp.text
            res = ws.call("proc.spawn", {"text": name, "media": media})
            assert not res["ok"] and res["error"]["message"].startswith("media:"), res
            assert _media_files(root) == [], name
        assert ws.ok("proc.history", {"pid": pid})["messages"] == []
        # the place looked at is where an accepted attachment goes
        resp = http.post(f"/v1/processes/{pid}/messages", json={"text": "fine", "media": [GOOD]})
        assert resp.status_code == 202, resp.text
        stored = _media_files(root)
        assert len(stored) == 1 and stored[0].parent.name == pid and stored[0].suffix == ".png"


# ------------------------------------------------------------------ titles


INVISIBLE = [
    "\u200b",  # ZERO WIDTH SPACE
    "\u200b \u200b",
    "\u200d",  # ZERO WIDTH JOINER
    "\ufeff\u2060",  # BYTE ORDER MARK, WORD JOINER
    "\u00ad",  # SOFT HYPHEN
    "\u3164",  # HANGUL FILLER (a letter drawn as blank)
    "\u2800",  # BRAILLE PATTERN BLANK
    "\ufe0f\u0301",  # a variation selector and a combining accent, on nothing
]
VISIBLE = ["\U0001f469\u200d\U0001f4bb work", "\U0001f469\u200d\U0001f4bb", "cafe\u0301", "x\u200by", "日本語"]


def test_a_title_of_only_invisible_characters_is_refused(server: KernelServer) -> None:
    """A title of zero-width or blank characters passed the blank check (``str.strip`` keeps them)
    and named the process with nothing a list shows. Refused now, as a blank title is, over HTTP
    and the WebSocket, leaving the title as it was; a title whose joiners join visible characters
    (an emoji sequence) is kept."""
    with _http(server, server.tokens["alice"]) as http, server.client("alice") as ws:
        pid = _spawn(http)
        assert http.post(f"/v1/processes/{pid}/title", json={"title": "before"}).json()["title"] == "before"
        for title in INVISIBLE:
            resp = http.post(f"/v1/processes/{pid}/title", json={"title": title})
            assert resp.status_code == 400, (title, resp.text)
            assert resp.json()["code"] == "invalid_request" and "visible" in resp.json()["message"], resp.text
            res: dict[str, Any] = ws.call("proc.title", {"pid": pid, "title": title})
            assert not res["ok"] and res["error"]["code"] == "invalid_request", res
            assert "visible" in res["error"]["message"], res
        assert http.get(f"/v1/processes/{pid}/title").json()["title"] == "before"
        blank = http.post(f"/v1/processes/{pid}/title", json={"title": "   "})
        assert blank.status_code == 400 and blank.json()["code"] == "invalid_request", blank.text
        for title in VISIBLE:
            resp = http.post(f"/v1/processes/{pid}/title", json={"title": title})
            assert resp.status_code == 200 and resp.json()["title"] == title, resp.text
            assert ws.ok("proc.title", {"pid": pid, "title": f" {title} "})["title"] == title
        assert ws.ok("proc.title", {"pid": pid})["title"] == VISIBLE[-1]


async def test_the_library_and_chat_refuse_an_invisible_title_too(tmp_path: Path) -> None:
    """The check lives in ``check_title``: ``Process.set_title`` (the library, ``/title`` in chat)
    refuses what the server refuses, and keeps the title it had."""
    from agentloop.kernel import Kernel
    from agentloop.kernel.titles import check_title

    assert check_title(" 👩\u200d💻 work ") == "👩\u200d💻 work"
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=ScriptedModel([]), workspace=tmp_path) as kernel:
        proc = await kernel.spawn(owner="alice")
        await proc.set_title("kept")
        for invisible in ("\u200b", "\u200d\u2060", "\u3164", "\u2800 \ufeff"):
            with pytest.raises(ValueError, match="visible character"):
                await proc.set_title(invisible)
        assert await proc.title() == "kept"
