"""The web console's files as the edge serves them (the page in a browser: tests/ops/test_console.py)."""

from __future__ import annotations

import asyncio
import re

from tests.http.asgi import call


def get(app, path, headers=None):
    return asyncio.run(call(app, "GET", path, headers=headers))


def test_page_and_every_file_it_loads_are_served_under_a_strict_policy(make_app, fake):
    app = make_app(fake)
    page = get(app, "/")
    assert page.status == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    html = page.body.decode()
    # Nothing is fetched from elsewhere: every reference is this edge's /console/.
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert refs and all(ref.startswith("/console/") for ref in refs), refs
    files = {ref.removeprefix("/console/") for ref in refs}
    # ...and the scripts' own imports, followed transitively.
    todo = [f for f in files if f.endswith(".js")]
    while todo:
        body = get(app, f"/console/{todo.pop()}").body.decode()
        for name in re.findall(r'^import .* from "\./([\w.-]+)";$', body, re.M):
            if name not in files:
                files.add(name)
                todo.append(name)
        assert not re.search(r"""(fetch|import)\(\s*["'`]https?:""", body)
    types = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8", "svg": "image/svg+xml"}
    for name in files:
        r = get(app, f"/console/{name}")
        assert r.status == 200 and r.headers["content-type"] == types[name.rsplit(".", 1)[1]], name
        assert r.headers["content-security-policy"] == policy
    assert {"main.js", "chat.js", "cluster.js", "markdown.js", "api.js", "console.css"} <= files


def test_unchanged_files_revalidate_with_their_etag(make_app, fake):
    app = make_app(fake)
    first = get(app, "/console/main.js")
    assert first.headers["cache-control"] == "no-cache"
    again = get(app, "/console/main.js", headers={"If-None-Match": first.headers["etag"]})
    assert again.status == 304 and again.body == b""
    assert get(app, "/console/main.js", headers={"If-None-Match": '"stale"'}).status == 200


def test_unknown_files_are_404_with_an_openai_error(make_app, fake):
    app = make_app(fake)
    for path in ("/console/nope.js", "/console/index.html", "/console/..%2Fapp.py", "/console/"):
        r = get(app, path)
        assert r.status == 404, path
        assert r.json()["error"]["code"] == "not_found"


def test_the_setting_turns_the_console_off(make_app, fake):
    app = make_app(fake, console=False)
    assert get(app, "/").status == 404
    assert get(app, "/console/main.js").status == 404
    assert get(app, "/v1/models").status == 200


def test_the_page_is_public_the_api_behind_it_is_not(make_app, fake, tmp_path):
    key = tmp_path / "key"
    key.write_text("sekrit\n")
    app = make_app(fake, api_key_file=str(key))
    assert get(app, "/").status == 200 and get(app, "/console/chat.js").status == 200
    assert get(app, "/console/settings.json").json() == {"api_key_required": True}
    assert get(make_app(fake), "/console/settings.json").json() == {"api_key_required": False}
    assert get(app, "/v1/stats").status == 401
    assert get(app, "/v1/stats", headers={"Authorization": "Bearer sekrit"}).status == 200
