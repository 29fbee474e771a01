"""The web console end to end: headless Chromium against a real `tandem serve`.

The page asks for the edge's API key and loads without a console error (a
Content-Security-Policy violation, a script error or a failed request would be one), a
chat message streams an answer through the edge's
OpenAI API, Stop aborts a long one, the cluster view lists the prefill and decode
workers and follows a killed decode worker down and back up, and the page fits a
phone's width. Skipped, with the reason, where no Chromium or no Playwright is found;
CI installs Debian's chromium (.ci/run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from tests.ops.test_serve import pids_in_session, serve  # noqa: F401  (the fixture)

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium found (Debian: apt-get install chromium); the console's browser test needs one")


@pytest.fixture
def browser():
    executable = _browser()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


def _card(page, node: str, state: str) -> str:
    return f'.worker[data-node="{node}"][data-state="{state}"]'


@pytest.mark.timeout(300)
def test_console_chats_streams_and_follows_the_cluster(serve, browser, tmp_path):  # noqa: F811
    key = tmp_path / "api-key"
    key.write_text("console-test-key\n")
    s = serve("--api-key-file", str(key))
    s.wait_for("ready: http://")
    s.wait_for(f"console: {s.url}/")
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="dark")
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

    page.goto(s.url + "/")
    assert page.title() == "tandem console"
    # The edge requires an API key: the page asks for it before its first call.
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "console-test-key")
    page.click("#key-form button[type=submit]")
    # The cluster view lists both workers, up, under their redacted ids only.
    page.wait_for_selector(_card(page, "prefill-0", "up"), timeout=20_000)
    page.wait_for_selector(_card(page, "decode-0", "up"), timeout=20_000)
    assert page.text_content('.worker[data-node="prefill-0"] .role') == "prefill"
    assert "tcp://" not in page.text_content("#cluster")
    page.wait_for_function("() => document.querySelector('#model').textContent.length > 1 && !document.querySelector('#model').textContent.includes('…')")
    page.wait_for_function("() => document.querySelector('#ready').textContent === 'ready'")
    assert problems == [], problems

    # Model text is rendered as Markdown, never as HTML: no element or script from it.
    rendered = page.evaluate("""async () => {
      const { renderMarkdown } = await import("/console/markdown.js");
      const box = document.createElement("div");
      renderMarkdown(box, '<img src=x onerror="window.pwned=1"> [a](javascript:window.pwned=1) [b](https://example.com/x)\\n\\n' +
        '**bold** `<b>code</b>`\\n\\n```js\\n<script>window.pwned=1</script>\\n```\\n\\n- one\\n- two');
      return { tags: box.querySelectorAll("img, script, b").length, links: [...box.querySelectorAll("a")].map((a) => a.href),
               strong: box.querySelector("strong").textContent, code: box.querySelector("p code").textContent,
               pre: box.querySelector("pre code").textContent, items: box.querySelectorAll("li").length,
               text: box.textContent, pwned: window.pwned === 1 };
    }""")
    assert rendered["tags"] == 0 and not rendered["pwned"]
    assert rendered["links"] == ["https://example.com/x"]
    assert rendered["strong"] == "bold" and rendered["code"] == "<b>code</b>" and rendered["items"] == 2
    assert rendered["pre"] == "<script>window.pwned=1</script>" and '<img src=x onerror="window.pwned=1">' in rendered["text"]

    # Every chat request gains ignore_eos on its way out, so only max_tokens or the Stop
    # button ends an answer: greedy text differs by CPU, and the tiny model may emit EOS.
    def no_eos(route):
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))

    page.route("**/v1/chat/completions", no_eos)

    # A message streams an answer: several SSE deltas, then usage and a finish reason.
    page.click("#params summary")
    page.fill("#p-max-tokens", "16")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    answer = page.wait_for_selector("article.assistant[data-finish]", timeout=60_000)
    assert answer.get_attribute("data-finish") == "length"
    assert int(answer.get_attribute("data-chunks")) > 1
    assert page.text_content("article.user .body") == "Hello"
    assert answer.query_selector(".body").inner_text().strip()
    assert page.text_content("article.assistant .meta").startswith("16 tokens")

    # Stop ends a long answer early (the requests carry ignore_eos, above).
    page.fill("#p-max-tokens", "3000")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    page.wait_for_function("() => Number(document.querySelectorAll('article.assistant')[1]?.dataset.chunks || 0) >= 3", timeout=60_000)
    assert page.text_content("#send") == "Stop"
    page.click("#send")
    page.wait_for_function("() => document.querySelectorAll('article.assistant')[1].dataset.finish", timeout=10_000)
    second = page.query_selector_all("article.assistant")[1]
    assert second.get_attribute("data-finish") == "stopped"
    assert page.text_content("#send") == "Send"
    # The abort reached the worker: the broker soon holds no running request.
    page.wait_for_function("() => document.querySelector('[data-tile=queue] .sub')?.textContent.endsWith(' 0 running')", timeout=20_000)

    # Kill the decode worker: the view shows it down, then back up once serve restarts it.
    decode = [p for p in pids_in_session(s.proc.pid) if "--role\0decode" in open(f"/proc/{p}/cmdline").read()]
    assert len(decode) == 1
    s.descendants |= pids_in_session(s.proc.pid)
    os.kill(decode[0], signal.SIGKILL)
    # Down once its heartbeats lapse; or joining again under its name, where serve restarted
    # it before they lapsed (seen on a loaded machine).
    page.wait_for_function(
        "() => [...document.querySelectorAll('#events li')].some(li => /decode-0 (is down|failed|is joining)/.test(li.textContent))",
        timeout=30_000)
    page.wait_for_function(
        "() => [...document.querySelectorAll('#events li')].some(li => /decode-0 (is up|failed and is back)/.test(li.textContent))",
        timeout=90_000)
    page.wait_for_selector(_card(page, "decode-0", "up"), timeout=30_000)
    assert page.query_selector(_card(page, "prefill-0", "up"))

    # A phone: one column, tabs switch between the views, nothing wider than the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.is_visible("#chat") and not page.is_visible("#cluster")
    page.click("[role=tab][data-tab=cluster]")
    assert page.is_visible("#cluster") and not page.is_visible("#chat")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert problems == [], problems
    context.close()
