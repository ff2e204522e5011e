"""The web UI's process list with subagents, in headless Chromium (tests/cdp.py).

A conversation that used the Task tool has child processes (``parent_pid`` set). The list shows the
top-level processes; each parent carries a toggle counting its subagents, collapsed by default,
and expanding it shows the children indented under their parent, where a click opens one. A
child whose parent is not in the list (killed) is shown at the top level.

Without Chromium the test skips, unless ``AGENTLOOP_REQUIRE_BROWSER=1`` (CI) makes it fail.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cdp import Browser
from tests.server_support import LiveServer
from tests.test_web_ui_browser import FOLLOWING


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    srv = LiveServer(tmp_path, kernel_options={"heartbeat": None}).start()
    try:
        yield srv
    finally:
        srv.stop()


def spawn(server: LiveServer, parent_pid: str | None = None, owner: str = "alice") -> str:
    """A process of ``owner``'s, spawned through the server's kernel (a subagent of ``parent_pid``)."""
    assert server.ctx is not None
    kernel = server.ctx.kernel
    process = asyncio.run(server.run(lambda: kernel.spawn(owner=owner, parent_pid=parent_pid)))
    return str(process.pid)


def forget(server: LiveServer, pid: str) -> None:
    """Take ``pid`` out of the registry, leaving its children: a parent gone on its own."""
    assert server.ctx is not None
    store = server.ctx.kernel.store

    async def drop() -> None:
        store.db.execute("DELETE FROM processes WHERE pid = ?", (pid,))  # type: ignore[attr-defined]

    asyncio.run(server.run(drop))


def item(pid: str) -> str:
    return f"document.querySelector('#processes li[data-pid={json.dumps(pid)}]')"


def shown(pid: str) -> str:
    """Whether the list shows ``pid``'s item (it is there and takes room on the page)."""
    return f"(() => {{ const li = {item(pid)}; return !!li && li.getClientRects().length > 0; }})()"


def left(pid: str) -> str:
    """Where the text of ``pid``'s item begins, in pixels from the list's left edge."""
    name = f"{item(pid)}.querySelector('.name')"
    box = "document.getElementById('processes').getBoundingClientRect().left"
    return f"{name}.getBoundingClientRect().left - {box}"


def test_subagents_are_folded_under_their_parent_and_open_on_click(server: LiveServer, browser: Browser) -> None:
    parent = spawn(server)
    first = spawn(server, parent)
    second = spawn(server, parent)
    grandchild = spawn(server, first)
    orphan_parent = spawn(server)
    orphan = spawn(server, orphan_parent)
    forget(server, orphan_parent)  # (killing a parent kills its children: this one went alone)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.tokens.alice}"}) as api:
        api.post(f"/v1/processes/{parent}/title", json={"title": "Research trip"}).raise_for_status()
        listed = {p["pid"]: p["parent_pid"] for p in api.get("/v1/processes").json()["processes"]}
    assert (
        listed[first] == parent
        and listed[grandchild] == first
        and listed[orphan] == orphan_parent
        and orphan_parent not in listed
    )

    browser.navigate(server.url + "/")
    browser.wait("!document.getElementById('signin').hidden")
    browser.type_into("token", server.tokens.alice)
    browser.eval("document.getElementById('signin-form').requestSubmit()")
    browser.wait(f"{shown(parent)}")

    # Top level: the parent (its title, its pid as the tooltip) and the orphan; the children folded.
    assert browser.eval(f"{item(parent)}.querySelector('.name').textContent") == "Research trip"
    assert browser.eval(f"{item(parent)}.title") == parent
    assert browser.eval(shown(orphan))
    for pid in (first, second, grandchild):
        assert not browser.eval(shown(pid)), pid
    toggle = f"{item(parent)}.querySelector('.subagents')"
    assert browser.eval(f"{toggle}.textContent") == "▸ 2 subagents"

    # Expanded: the children right under their parent, indented; the grandchild still folded.
    browser.eval(f"{toggle}.click()")
    browser.wait(f"{shown(first)} && {shown(second)}")
    assert browser.eval(f"{toggle}.textContent") == "▾ 2 subagents"
    order = browser.eval("[...document.querySelectorAll('#processes li')].map((li) => li.dataset.pid)")
    assert order.index(parent) < order.index(first) < order.index(second)
    assert set(order[order.index(parent) + 1 : order.index(parent) + 4]) == {first, second, grandchild}
    assert not browser.eval(shown(grandchild))
    assert browser.eval(left(first)) > browser.eval(left(parent)) + 8
    assert browser.eval(left(first)) == browser.eval(left(second))
    assert abs(browser.eval(left(orphan)) - browser.eval(left(parent))) < 2  # top level (a title's font is larger)
    assert browser.eval("document.getElementById('proc-title').textContent") == "No process selected"  # no open

    # One level more: the grandchild under its parent.
    browser.eval(f"{item(first)}.querySelector('.subagents').click()")
    browser.wait(shown(grandchild))
    assert browser.eval(f"{item(first)}.querySelector('.subagents').textContent") == "▾ 1 subagent"
    assert browser.eval(left(grandchild)) > browser.eval(left(first)) + 8

    # A click on a child opens it, selected in the list.
    browser.click(f"#processes li[data-pid={json.dumps(second)}]")
    assert browser.wait(f"{FOLLOWING} && document.getElementById('proc-title').textContent") == second
    selected = browser.eval("[...document.querySelectorAll('#processes li.selected')].map((li) => li.dataset.pid)")
    assert selected == [second]
