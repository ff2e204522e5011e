"""The browser UI's static routes: the page and its assets, their security headers, and that no
request path reaches a file outside the fixed table (the browser itself: test_web_ui_browser.py)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from agentloop.process.approval.denial import MAX_DENIAL_MESSAGE
from agentloop.server import web
from tests.server_support import LiveServer, live_server

WEB = Path(web.__file__).parent / "web"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("web")) as srv:
        yield srv


@pytest.fixture
async def anonymous(server: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    async with server.client(None) as client:
        yield client


def assert_secured(resp: httpx.Response) -> None:
    csp = resp.headers["content-security-policy"]
    directives = {d.split()[0]: d.split()[1:] for d in csp.split("; ")}
    assert directives["default-src"] == ["'self'"]
    assert directives["script-src"] == ["'self'"]  # no 'unsafe-inline', no 'unsafe-eval'
    assert directives["frame-ancestors"] == ["'none'"]
    assert directives["object-src"] == ["'none'"]
    assert "unsafe" not in csp
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert resp.headers["referrer-policy"] == "no-referrer"
    assert resp.headers["x-frame-options"] == "DENY"


async def test_the_page_is_served_without_a_token_with_strict_security_headers(anonymous: httpx.AsyncClient) -> None:
    resp = await anonymous.get("/")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/html; charset=utf-8"
    assert_secured(resp)
    assert resp.content == (WEB / "index.html").read_bytes()
    assert '<script type="module" src="/static/app.js"></script>' in resp.text
    # Nothing inline for the CSP to have to allow: no inline script body, no handler attributes.
    assert re.search(r"<script(?![^>]*\bsrc=)[^>]*>", resp.text) is None
    assert re.search(r"\son[a-z]+=", resp.text) is None
    head = await anonymous.head("/")
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == str(len(resp.content))


@pytest.mark.parametrize(
    ("name", "content_type"),
    [
        ("app.js", "text/javascript; charset=utf-8"),
        ("api.js", "text/javascript; charset=utf-8"),
        ("dom.js", "text/javascript; charset=utf-8"),
        ("view.js", "text/javascript; charset=utf-8"),
        ("app.css", "text/css; charset=utf-8"),
        ("icon.svg", "image/svg+xml"),
    ],
)
async def test_assets_have_their_content_types(anonymous: httpx.AsyncClient, name: str, content_type: str) -> None:
    resp = await anonymous.get(f"/static/{name}")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == content_type
    assert resp.content == (WEB / name).read_bytes()
    assert_secured(resp)


async def test_the_scripts_never_render_with_inner_html(anonymous: httpx.AsyncClient) -> None:
    names = [name for name in web.ASSETS if name.endswith(".js")]
    script = "\n".join([(await anonymous.get(f"/static/{name}")).text for name in names])
    code = re.sub(r"/\*.*?\*/", "", script, flags=re.DOTALL)  # comments may name the sinks
    code = re.sub(r"//.*$", "", code, flags=re.MULTILINE)
    assert "textContent" in code
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in code, sink
    assert "sessionStorage" in code and "localStorage" not in code
    assert "Authorization" in code and "token=" not in code and "access_token" not in code


@pytest.mark.parametrize(
    "path",
    [
        "/static/nope.js",
        "/static/index.html",  # the page lives at / only
        "/static/",
        "/static/../../pyproject.toml",
        "/static/..%2F..%2Fpyproject.toml",
        "/static/%2e%2e/%2e%2e/pyproject.toml",
        "/static/%2e%2e%2f%2e%2e%2fpyproject.toml",
        "/static/..%5c..%5cpyproject.toml",
        "/static/%252e%252e%252fpyproject.toml",
        "/static/app.js/../../pyproject.toml",
        "/static//etc/passwd",
        "/static/%2fetc%2fpasswd",
        "/static/web.py",
        "/static/__init__.py",
        "/index.html",
        "/app.js",
    ],
)
async def test_unknown_assets_and_path_traversal_answer_404(anonymous: httpx.AsyncClient, path: str) -> None:
    # httpx would normalise "..": send the raw target as written.
    request = anonymous.build_request("GET", path)
    request.url = request.url.copy_with(raw_path=path.encode())
    resp = await anonymous.send(request)
    assert resp.status_code == 404, (path, resp.text[:200])
    assert resp.json()["code"] == "not_found"
    assert "[project]" not in resp.text and "root:" not in resp.text


async def test_the_ui_routes_take_no_token_but_the_api_still_does(
    server: LiveServer, anonymous: httpx.AsyncClient
) -> None:
    assert (await anonymous.get("/static/app.js")).status_code == 200
    for path in ("/v1/me", "/v1/processes"):
        resp = await anonymous.get(path)
        assert resp.status_code == 401 and resp.json()["code"] == "unauthorized"
        assert "content-security-policy" not in resp.headers  # the UI's headers are the UI's own
    async with server.client(server.tokens.alice) as alice:
        assert (await alice.get("/v1/me")).json() == {"account": "alice", "admin": False}
        # A token sent along changes nothing about the UI's answers, and the UI takes no other method.
        assert (await alice.get("/")).content == (WEB / "index.html").read_bytes()
        assert (await alice.post("/", json={})).status_code == 405


def test_the_assets_ship_in_the_wheel() -> None:
    """hatch packages every file under src/agentloop, so the UI is package data; nothing in the
    build configuration may exclude it."""
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert 'packages = ["src/agentloop"]' in pyproject
    assert "exclude" not in pyproject.split("[tool.hatch.build.targets.wheel]")[1].split("\n[")[0]
    assert set(web.load_assets()) == {"index.html", "app.js", "api.js", "dom.js", "view.js", "app.css", "icon.svg"}
    assert {p.name for p in WEB.iterdir()} == set(web.load_assets())  # no file left out of the table


def test_the_deny_reason_box_takes_what_the_server_accepts() -> None:
    """The page's limit on a denial's reason is the one the server checks: a longer reason could
    be typed and then refused only once sent."""
    limits = re.findall(r"reason\.maxLength = (\d+);", (WEB / "view.js").read_text())
    assert limits == [str(MAX_DENIAL_MESSAGE)]
