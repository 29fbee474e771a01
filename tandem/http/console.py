"""The web console: a static single page at ``/`` (chat playground, live cluster view).

The page and its scripts are package data (``tandem/http/static/``) read once when the
app is built and served from memory: no build step, nothing fetched from elsewhere at
run time. It talks to this edge only, through the same OpenAI API, ``/v1/stats`` and
``/metrics`` any client sees (so the API key and the stats redaction apply to it
unchanged). A strict Content-Security-Policy keeps the page to its own scripts and this
origin: even a rendering bug could not run model-written script or send data elsewhere.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources

import falcon

from tandem.http.errors import ApiError

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".json": "application/json",
}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate every load (ETag makes that a 304): an upgraded edge never serves stale scripts.
    "Cache-Control": "no-cache",
}


class _Asset:
    def __init__(self, name: str, data: bytes):
        self.data = data
        self.content_type = _TYPES[name[name.rfind("."):]]
        self.etag = '"' + hashlib.sha256(data).hexdigest()[:32] + '"'


def load_assets() -> dict[str, _Asset]:
    """Every file of the console, by name."""
    root = resources.files("tandem.http") / "static"
    return {f.name: _Asset(f.name, f.read_bytes()) for f in root.iterdir()
            if f.is_file() and f.name[f.name.rfind("."):] in _TYPES}


class ConsoleResource:
    """``GET /`` (the page), ``GET /console/{name}`` (its scripts, styles, icon) and
    ``GET /console/settings.json`` (what the page must know before its first call)."""

    def __init__(self, assets: dict[str, _Asset], *, api_key_required: bool):
        if "index.html" not in assets:
            raise ValueError("the web console's index.html is missing from the package (tandem/http/static)")
        # Told up front so that the page asks for the key instead of failing a call first.
        settings = json.dumps({"api_key_required": api_key_required}).encode()
        self.assets = {**assets, "settings.json": _Asset("settings.json", settings)}

    async def on_get(self, req, resp):
        self._send(req, resp, self.assets["index.html"])

    async def on_get_asset(self, req, resp, name):
        asset = self.assets.get(name)
        if asset is None or name == "index.html":
            raise ApiError(404, f"no console file {name!r}", code="not_found")
        self._send(req, resp, asset)

    @staticmethod
    def _send(req, resp, asset: _Asset) -> None:
        resp.set_headers(_HEADERS)
        resp.etag = asset.etag
        if asset.etag in (req.get_header("If-None-Match") or ""):
            resp.status = falcon.HTTP_304
            return
        resp.content_type = asset.content_type
        resp.data = asset.data
