"""The README read top to bottom as a new user would, checked against what the commands do: the
quick start's piped ``serve --chat`` on ``examples/demo``, where the config file is looked for,
which model wins, ``run`` without a terminal, the client commands against a real ``agentloop
serve``, the web UI's files and headers, and ``/attach``'s paths. (test_readme_examples.py runs
the README's code fences and checks its command lines name real flags; this file checks that
the commands behave as the prose says.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from agentloop.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DEMO = ROOT / "examples" / "demo"
KEYS = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")
KEYS += ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GEMINI_BASE_URL")
AGENTLOOP_VARS = ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA", "AGENTLOOP_STORE", "AGENTLOOP_CONFIG")
AGENTLOOP_VARS += ("AGENTLOOP_SERVER", "AGENTLOOP_TOKEN")

runner = CliRunner()


def script(path: Path, replies: list[Any]) -> str:
    path.write_text(json.dumps({"replies": replies}), encoding="utf-8")
    return f"scripted:{path}"


def read_demo_config() -> dict[str, Any]:
    return {"tool_calls": [{"name": "Read", "arguments": {"path": "config.yaml"}}]}


def clean_env(tmp: Path) -> dict[str, str]:
    """A subprocess's environment: no key, no agentloop setting, its own config and data."""
    env = {k: v for k, v in os.environ.items() if k not in KEYS and k not in AGENTLOOP_VARS}
    env.update(
        HOME=str(tmp / "home"),
        XDG_DATA_HOME=str(tmp / "xdg-data"),
        XDG_CONFIG_HOME=str(tmp / "xdg-config"),
        PYTHONUNBUFFERED="1",
    )
    return env


def agentloop(*args: str) -> list[str]:
    """The console script, as a user runs it (``python -m`` of its entry point)."""
    return [sys.executable, "-c", "import sys; from agentloop.cli.entry import main; sys.exit(main())", *args]


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*KEYS, *AGENTLOOP_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))


# ---------------------------------------------------------------------------------- the quick start


def test_quickstart_piped_serve_chat_answers_on_stdout_and_continues(tmp_path: Path) -> None:
    """``echo "Which port?" | agentloop serve --chat --workspace examples/demo`` answers on stdout
    and exits; the first start prints the admin token once (not again); running it again continues
    the conversation, ``--new`` starts a fresh one. The demo's config.yaml holds the port the
    README's question asks about, read with the built-in tools rooted in ``examples/demo``."""
    assert "--workspace examples/demo" in README and "Which port?" in README
    env = clean_env(tmp_path)

    def serve_chat(text: str, replies: list[Any], *extra: str) -> subprocess.CompletedProcess[str]:
        model = script(tmp_path / f"s{len(replies)}.json", replies)  # (a script starts afresh each start)
        args = ["serve", "--chat", "--port", "0", "--model", model, "--workspace", str(DEMO), *extra]
        done = subprocess.run(agentloop(*args), input=text, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        return done

    first = serve_chat("Which port?\n", [read_demo_config(), "It listens on port 8081."])
    assert first.stdout.strip() == "It listens on port 8081."  # the answer alone, on stdout
    assert "its token: al_" in first.stderr and "shown only this once" in first.stderr
    assert "✓ Read config.yaml" in first.stderr  # the tool activity goes to stderr
    data = tmp_path / "xdg-data" / "agentloop"
    assert (data / "agentloop.db").is_file()  # data in $XDG_DATA_HOME/agentloop (~/.local/share/...)

    second = serve_chat("And the host?\n", ["again"])
    assert second.stdout.strip() == "again"
    assert "token: al_" not in second.stderr  # printed once only
    assert "continuing conversation" in second.stderr and "(4 messages)" in second.stderr

    third = serve_chat("Start over\n", ["fresh", "-"], "--new")
    assert third.stdout.strip() == "fresh" and "new conversation" in third.stderr
    # the demo file really says what the answer claims
    assert re.search(r"^\s*port:\s*8081\s*$", (DEMO / "config.yaml").read_text(), flags=re.M)


def test_the_two_promised_commands_match_the_scripts() -> None:
    """The install-and-run command and the test command are near the top, and are what
    scripts/ and CI run."""
    top = README[: README.index("## The library")]
    assert "bash scripts/install.sh local,server && .venv/bin/agentloop serve --chat --workspace examples/demo" in top
    assert "```bash\nbash scripts/test.sh\n```" in top
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert "extras=${1:-local,server}" in install and 'pip install -q -e ".[$extras]"' in install.replace(
        '"${pip[@]}"', "pip"
    )
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert "bash scripts/install.sh dev,local-small" in test and "-m pytest" in test
    assert 'if [ "$workers" -gt 4 ]; then workers=4; fi' in test  # one worker per core, up to 4
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exec bash scripts/test.sh" in ci and "AGENTLOOP_REQUIRE_BROWSER=1" in ci


# ---------------------------------------------------------------------------------- configuration


def test_config_file_default_path_and_model_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model``, else ``AGENTLOOP_MODEL``, else ``model`` in ``$XDG_CONFIG_HOME/agentloop/config.toml``
    (when ``$AGENTLOOP_CONFIG`` is not set); ``workspace`` from the file is where tools work."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "where.txt").write_text("in the configured workspace\n")
    config_dir = tmp_path / "xdg-config" / "agentloop"
    config_dir.mkdir(parents=True)
    read = {"tool_calls": [{"name": "Read", "arguments": {"path": "where.txt"}}]}
    from_file = script(tmp_path / "file.json", [read, "file"])
    (config_dir / "config.toml").write_text(f'model = "{from_file}"\nworkspace = "{ws}"\n')
    result = runner.invoke(app, ["run", "hi"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "file" and "✓ Read where.txt" in result.stderr

    monkeypatch.setenv("AGENTLOOP_MODEL", script(tmp_path / "env.json", ["env"]))
    assert runner.invoke(app, ["run", "hi"]).stdout.strip() == "env"
    flag = script(tmp_path / "flag.json", ["flag"])
    assert runner.invoke(app, ["run", "--model", flag, "hi"]).stdout.strip() == "flag"


def test_run_without_a_terminal_refuses_a_risky_call_unless_auto(tmp_path: Path) -> None:
    """``run`` without a terminal treats a call the policy asks about as a tool error unless
    given ``--approval auto``."""
    ws = tmp_path / "ws"
    (ws / "build").mkdir(parents=True)
    rm = {"tool_calls": [{"name": "Shell", "arguments": {"command": "rm -rf build"}}]}
    env = clean_env(tmp_path)
    base = ["run", "--workspace", str(ws), "clean up"]
    asked = subprocess.run(
        agentloop("run", "--model", script(tmp_path / "a.json", [rm, "done"]), *base[1:]),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert asked.returncode == 0, asked.stderr
    assert (ws / "build").is_dir()  # not run
    assert "✗ Shell" in asked.stderr or "denied" in asked.stderr
    auto = subprocess.run(
        agentloop("run", "--model", script(tmp_path / "b.json", [rm, "done"]), "--approval", "auto", *base[1:]),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert auto.returncode == 0, auto.stderr
    assert not (ws / "build").exists()


# ---------------------------------------------------------------------------------- a real server


class Served:
    def __init__(self, url: str, token: str, env: dict[str, str]) -> None:
        self.url, self.token, self.env = url, token, env

    def cli(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        env = {**self.env, "AGENTLOOP_SERVER": self.url, "AGENTLOOP_TOKEN": self.token}
        return subprocess.run(agentloop(*args), input=stdin, capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``agentloop serve`` on a free port, with a scripted model that answers every message."""
    tmp = tmp_path_factory.mktemp("served")
    ws = tmp / "ws"
    (ws / "build").mkdir(parents=True)
    rm = {"tool_calls": [{"name": "Shell", "arguments": {"command": "rm -rf build"}}]}
    model = script(tmp / "s.json", [rm, "removed", *(f"answer {i}" for i in range(20))])
    env = clean_env(tmp)
    env["AGENTLOOP_CONFIG"] = str(tmp / "none.toml")
    proc = subprocess.Popen(
        agentloop("serve", "--port", "0", "--data", str(tmp / "data"), "--model", model, "--workspace", str(ws)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    token = url = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if found := re.search(r"its token: (\S+)", line):
            token = found.group(1)
        if found := re.search(r"web UI: (http://\S+)/ ", line):
            url = found.group(1)
            break
    try:
        assert token and url, "the server did not print its token and address"
        yield Served(url, token, env)
    finally:
        proc.terminate()
        proc.wait(20)


def test_client_commands_approve_a_waiting_call(served: Served) -> None:
    """The default policy makes ``rm -rf`` wait for a person: ``agentloop approve PID`` (the only
    pending request) lets it run; ``history`` shows the answer; ``send PID -`` reads stdin."""
    headers = {"Authorization": f"Bearer {served.token}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=20) as http:
        assert httpx.get(f"{served.url}/v1/health").json() == {"ok": True}  # no token
        pid = http.post("/v1/processes", json={"text": "clean the build"}).json()["pid"]
        for _ in range(100):
            if http.get(f"/v1/processes/{pid}/hil").json()["requests"]:
                break
            time.sleep(0.05)
        [request] = http.get("/v1/approvals").json()["requests"]
        assert request["pid"] == pid and "destructive" in request["tags"]
    approved = served.cli("approve", pid)
    assert approved.returncode == 0 and approved.stdout.strip() == f"approved {request['request_id']}"
    watched = served.cli("watch", pid, "--until-done", "--json")
    assert watched.returncode == 0, watched.stderr
    signals = [json.loads(line)["signal"] for line in watched.stdout.splitlines()]
    assert signals[-1] == "proc.run.finished"
    assert served.cli("history", pid).stdout.splitlines()[-1] == "assistant: removed"
    sent = served.cli("send", pid, "-", stdin="from stdin\n")
    assert sent.returncode == 0 and sent.stdout.strip()
    assert served.cli("deny", pid).returncode == 1  # nothing pending: a one-line error, exit 1


def test_watch_until_done_exits_without_a_traceback(served: Served) -> None:
    """The event stream's inner generators were left to the loop's finalizer, in another task,
    when ``watch`` stopped reading: their httpx stream failed to close there, with a traceback."""
    headers = {"Authorization": f"Bearer {served.token}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=20) as http:
        pid = http.post("/v1/processes", json={"text": "hello"}).json()["pid"]
    watched = served.cli("watch", pid, "--until-done")
    assert watched.returncode == 0
    assert "Traceback" not in watched.stderr and "error occurred" not in watched.stderr


def test_web_ui_is_a_page_four_modules_a_stylesheet_and_an_icon(served: Served) -> None:
    """``/`` serves the page with a strict Content-Security-Policy (no inline script, no framing);
    it is a page, four ES modules, a stylesheet and an icon."""
    page = httpx.get(f"{served.url}/")
    assert page.status_code == 200 and "<script>" not in page.text
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    web = ROOT / "src" / "agentloop" / "server" / "web"
    files = sorted(p.name for p in web.iterdir() if p.is_file())
    assert len([f for f in files if f.endswith(".js")]) == 4
    assert [f for f in files if not f.endswith(".js")] == ["app.css", "icon.svg", "index.html"]
    for name in files:
        if name != "index.html":
            assert httpx.get(f"{served.url}/static/{name}").status_code == 200, name


# ---------------------------------------------------------------------------------- chat's /attach


def test_attach_names_the_directory_a_relative_path_was_looked_for_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/attach FILE`` reads a path from the current directory, not the workspace: a file that
    is only in the workspace was refused as "is not a file", with no hint of where it was looked for."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("in the workspace\n")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert "`/attach FILE` (a path from the current directory)" in README
    model = script(tmp_path / "s.json", ["ok"])
    result = runner.invoke(app, ["chat", "--memory", "-m", model, "-w", str(ws)], "/attach notes.txt\n")
    assert result.exit_code == 0, result.stderr
    assert f"notes.txt is not a file (no such file in the current directory, {here})" in result.stderr
    (here / "notes.txt").write_text("here\n")
    result = runner.invoke(app, ["chat", "--memory", "-m", model, "-w", str(ws)], "/attach notes.txt\nread it\n")
    assert "(attached notes.txt (text/plain, 5 bytes)" in result.stderr
