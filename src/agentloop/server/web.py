"""The browser UI's static files: ``GET /`` is the page, ``GET /static/<name>`` its script and style.

The files hold no data, so they are served without a token; everything the page shows comes from
the authenticated ``/v1`` API, called by the page with the bearer token the user typed in.

Files are read once, from the package (``agentloop/server/web/``), into a fixed table keyed by
name: a request can only ever name one of those entries, so no path (``..``, encoded slashes,
absolute paths) reaches the file system. Every answer carries a strict Content-Security-Policy
(scripts and styles from this origin only, no inline script, no framing) as a second line of
defence behind the page's rule of rendering model and tool text with ``textContent`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

PATHS = ("/", "/static/{name}")  # the UI's routes: not part of the API, so not in the OpenAPI document
PAGE = "index.html"
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",  # the page; it imports the three modules below
    "api.js": "text/javascript; charset=utf-8",
    "dom.js": "text/javascript; charset=utf-8",
    "view.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",  # without an icon, every page load asks for /favicon.ico and gets a 404
}

CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",  # frame-ancestors' older twin, for browsers that predate it
    # Revalidate on every load: after an upgrade the page and its script must not come from two versions.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str


def load_assets() -> dict[str, Asset]:
    """The page and its assets, read from the package."""
    folder = resources.files("agentloop.server") / "web"
    table = {PAGE: Asset(folder.joinpath(PAGE).read_bytes(), "text/html; charset=utf-8")}
    for name, media_type in ASSETS.items():
        table[name] = Asset(folder.joinpath(name).read_bytes(), media_type)
    return table


def routes() -> list[BaseRoute]:
    """``/`` and ``/static/{name}`` (GET and HEAD)."""
    assets = load_assets()

    def answer(asset: Asset, request: Request) -> Response:
        body = b"" if request.method == "HEAD" else asset.body
        headers = {**SECURITY_HEADERS, "Content-Length": str(len(asset.body))}
        return Response(body, media_type=asset.media_type, headers=headers)

    async def page(request: Request) -> Response:
        return answer(assets[PAGE], request)

    async def static(request: Request) -> Response:
        asset = assets.get(request.path_params["name"])
        if asset is None or request.path_params["name"] == PAGE:
            raise HTTPException(404)
        return answer(asset, request)

    return [Route(PATHS[0], page, methods=["GET", "HEAD"]), Route(PATHS[1], static, methods=["GET", "HEAD"])]
