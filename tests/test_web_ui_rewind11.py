"""The web UI and rewinds, in headless Chromium (tests/cdp.py): a rewind made by another client cuts
the transcript back, "Rewind & edit" under a user message rewinds the conversation to just before it
with the message back in the composer, and a run under way refuses it (abort first).

The server is the tests' in-process one (tests/server_support.py, its scripted model: ``risky`` calls
a tool the approval policy asks about, which keeps the run active until answered; anything else
answers ``answer: <text>``).

Without Chromium the tests skip, unless ``AGENTLOOP_REQUIRE_BROWSER=1`` (CI) makes them fail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cdp import Browser
from tests.server_support import LiveServer, live_server
from tests.test_web_ui_browser import FOLLOWING, send, sign_in_and_open_a_process
from tests.test_web_ui_session import SHOWN, STATUS, finished, history, persisted

TIMEOUT = 30.0  # seconds any one condition may take on a loaded machine
REWIND = "#transcript .rewind-here"
COMPOSER = "document.getElementById('text').value"
OUTCOMES = "[...document.querySelectorAll('#transcript .footer[data-status]')].map((n) => n.textContent)"
# Every GET the page makes, by path (installed by a test, to see the header read again).
SPY = """window.__gets = [];
window.__spied = window.fetch;
window.fetch = (path, init) => {
  if (!init || !init.method || init.method === 'GET') window.__gets.push(String(path));
  return window.__spied(path, init);
};"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("web-rewind"), kernel_options={"heartbeat": None}) as srv:
        yield srv


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {server.tokens.alice}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as client:
        yield client


def ids(api: httpx.Client, pid: str) -> list[int]:
    messages: list[dict[str, Any]] = api.get(f"/v1/processes/{pid}/messages?limit=200").json()["messages"]
    return [m["id"] for m in messages]


def shown_is(browser: Browser, expected: list[tuple[str, str]]) -> None:
    """Wait until the transcript shows exactly ``expected`` (role, text), nothing pending or streaming."""
    want = json.dumps([list(pair) for pair in expected], separators=(",", ":"))
    browser.wait(
        f"JSON.stringify({SHOWN}) === {json.dumps(want)} && "
        "!document.querySelector('#transcript .msg.pending, #transcript .msg.live')",
        timeout=TIMEOUT,
    )


def exchanges(browser: Browser, *texts: str) -> None:
    for n, text in enumerate(texts, start=1):
        send(browser, text)
        browser.wait(f"document.querySelectorAll('#transcript .footer[data-status]').length === {n}", timeout=TIMEOUT)
    persisted(browser, len(texts))


def test_a_rewind_by_another_client_cuts_the_transcript_back_and_later_messages_show_as_usual(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = sign_in_and_open_a_process(browser, server.url, server.tokens.alice)
    exchanges(browser, "first", "second", "third")
    everything = [
        ("user", "first"),
        ("assistant", "answer: first"),
        ("user", "second"),
        ("assistant", "answer: second"),
        ("user", "third"),
        ("assistant", "answer: third"),
    ]
    shown_is(browser, everything)
    browser.eval(SPY)

    # Another client rewinds to the first answer, while the page follows the process.
    at = ids(api, pid)[1]
    done = api.post(f"/v1/processes/{pid}/rewind", json={"at": at})
    assert done.status_code == 200, done.text
    assert done.json()["kept"] == 2 and done.json()["removed"] == 4
    shown_is(browser, everything[:2])
    assert browser.eval("document.querySelectorAll('#transcript .msg-actions').length") == 1
    # The run still shown keeps its outcome, which only its signals told.
    browser.wait(f"{OUTCOMES}.join() === 'run finished: ok (turn.complete)'", timeout=TIMEOUT)
    # The header is read again (the context meter: the rewind forgot the context's reading).
    path = json.dumps(f"/v1/processes/{pid}")
    browser.wait(f"window.__gets.includes({path})", timeout=TIMEOUT)
    assert browser.eval("document.getElementById('proc-title').textContent") == pid

    # What comes next is shown as usual, after what was kept.
    send(browser, "fourth")
    shown_is(browser, [*everything[:2], ("user", "fourth"), ("assistant", "answer: fourth")])
    browser.wait(f"{OUTCOMES}.length === 2", timeout=TIMEOUT)
    assert browser.eval(f"{OUTCOMES}.every((t) => t.startsWith('run finished: ok'))") is True
    assert history(api, pid) == [*everything[:2], ("user", "fourth"), ("assistant", "answer: fourth")]

    # A reload shows the same: the rewound messages do not come back.
    browser.reload()
    browser.wait(FOLLOWING, timeout=TIMEOUT)
    shown_is(browser, [*everything[:2], ("user", "fourth"), ("assistant", "answer: fourth")])
    assert not [line for line in browser.console if "exception" in line], browser.console


def test_rewind_and_edit_cuts_the_conversation_back_with_the_message_in_the_composer(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = sign_in_and_open_a_process(browser, server.url, server.tokens.alice)
    exchanges(browser, "first", "second <b>edit me</b>", "third")
    before = history(api, pid)
    assert len(before) == 6
    assert browser.eval(f"document.querySelectorAll('{REWIND}').length") == 3
    title = browser.eval(f"document.querySelector('{REWIND}').title")
    assert "just before this message" in title and "archived" in title and "composer" in title

    # Declined at the confirm: nothing happens.
    browser.eval(f"document.querySelectorAll('{REWIND}')[1].click()")  # (returns once the confirm is answered)
    assert len(browser.dialogs) == 1 and browser.dialogs[0].startswith("confirm:"), browser.dialogs
    assert history(api, pid) == before
    assert browser.eval(COMPOSER) == ""
    assert browser.eval(STATUS) != "rewinding…"
    assert browser.eval("document.querySelectorAll('#transcript .msg').length") == 6

    # Accepted: the rewind's answer is held a while, and the rewind actions wait for it.
    browser.accept_dialogs = True
    browser.hold("POST", "*/rewind")
    browser.eval(f"document.querySelectorAll('{REWIND}')[1].click()")
    browser.wait(f"{STATUS} === 'rewinding…'", timeout=TIMEOUT)
    # The server rewound (its signal re-renders the transcript); the page has not had the answer yet.
    shown_is(browser, before[:2])
    assert history(api, pid) == before[:2]
    assert browser.eval(f"[...document.querySelectorAll('{REWIND}')].every((b) => b.disabled)") is True
    assert browser.eval(COMPOSER) == ""
    assert browser.release() == 1
    browser.wait(f"{COMPOSER} === {json.dumps('second <b>edit me</b>')}", timeout=TIMEOUT)
    browser.wait(f"{STATUS}.startsWith('rewound')", timeout=TIMEOUT)
    assert "4 messages archived" in browser.eval(STATUS)
    browser.wait(f"[...document.querySelectorAll('{REWIND}')].every((b) => !b.disabled)", timeout=TIMEOUT)
    assert browser.eval("document.querySelectorAll('b, img').length") == 0
    segments = api.get(f"/v1/processes/{pid}/segments").json()
    kinds = [s["kind"] for s in segments["segments"]]
    assert kinds == ["rewind"]

    # Sending the composer's text goes on from the rewound history, in the same process.
    browser.click("#send")
    after = [*before[:2], ("user", "second <b>edit me</b>"), ("assistant", "answer: second <b>edit me</b>")]
    shown_is(browser, after)
    browser.wait(f"{OUTCOMES}.length === 2", timeout=TIMEOUT)  # (the kept run's, and this one's)
    assert history(api, pid) == after
    assert browser.eval("document.getElementById('proc-title').textContent") == pid

    # The first message has nothing before it: the rewind goes back to the start.
    browser.eval("document.getElementById('text').value = ''")
    browser.eval(f"document.querySelectorAll('{REWIND}')[0].click()")
    browser.wait(f"{COMPOSER} === 'first'", timeout=TIMEOUT)
    shown_is(browser, [])
    assert history(api, pid) == []
    assert not [line for line in browser.console if "exception" in line], browser.console


def test_a_run_under_way_refuses_the_rewind_and_nothing_changes(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = sign_in_and_open_a_process(browser, server.url, server.tokens.alice)
    exchanges(browser, "first")
    send(browser, "risky")  # its tool call waits for an approval: the run stays active
    browser.wait("document.querySelector('#approvals .hil-deny')", timeout=TIMEOUT)
    persisted(browser, 2)
    before = history(api, pid)
    shown = browser.eval(SHOWN)
    assert api.get(f"/v1/processes/{pid}").json()["run_id"]

    browser.accept_dialogs = True
    browser.eval(f"document.querySelectorAll('{REWIND}')[1].click()")
    browser.wait(f"{STATUS} === 'not rewound: a run is active (abort it first)'", timeout=TIMEOUT)
    assert history(api, pid) == before
    assert browser.eval(SHOWN) == shown
    assert browser.eval(COMPOSER) == ""
    assert browser.eval(f"[...document.querySelectorAll('{REWIND}')].every((b) => !b.disabled)") is True
    segments = api.get(f"/v1/processes/{pid}/segments").json()
    assert segments["segments"] == []

    # The run ends (denied); then the same action rewinds.
    browser.click("#approvals .hil-deny")
    browser.wait("!document.getElementById('proc-state').textContent.startsWith('running')", timeout=TIMEOUT)
    finished(browser, 2)
    browser.eval(f"document.querySelectorAll('{REWIND}')[1].click()")
    browser.wait(f"{COMPOSER} === 'risky'", timeout=TIMEOUT)
    shown_is(browser, before[:2])
    assert history(api, pid) == before[:2]
    assert not [line for line in browser.console if "exception" in line], browser.console
