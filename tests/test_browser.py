"""The chat page at `/`, driven in a real browser: Debian's chromium through Playwright.

The server is real (`ferroxmp serve` through tests/serverproc.py) and so is its model:
tests/scripted_model.py builds a checkpoint whose weights write SCRIPT (markup
included) to every chat, greedily. Nothing between the browser and the model is
stubbed; the browser only talks to the server.

Oracles: SCRIPT itself (what the weights spell), the same request sent straight to
the API, and the server's own counters on /metrics and /stats.
"""
from __future__ import annotations

import os
import re
import tempfile
import time

import pytest
import requests
from tokenizers import Tokenizer

from scripted_model import SCRIPT, build_scripted_model
from serverproc import ServerProcess, serving

pytestmark = pytest.mark.timeout(300)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The README's picture is rewritten only when asked (FERROXMP_UPDATE_SCREENSHOT=1): a test
# run must not leave the working tree changed; otherwise the shot goes to a temp file.
SCREENSHOT = (os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "chat-page.png")
              if os.environ.get("FERROXMP_UPDATE_SCREENSHOT") == "1"
              else os.path.join(tempfile.gettempdir(), f"ferroxmp-chat-page-{os.getpid()}.png"))
API_KEY = "s3cret-key"
FLAGS = ("--page-size", "4", "--kv-pages", "512")
# Long enough that the first turn fills several pages, which the second turn adopts.
FIRST = "Please show me what a reply with HTML markup in it looks like on this page, as plain text."
SECOND = "Thanks. And once more, please."


# ---- fixtures ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return build_scripted_model(str(tmp_path_factory.mktemp("scripted") / "scripted-model"))


@pytest.fixture(scope="module")
def server(scripted):
    with serving(scripted[0], *FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A fresh chromium profile. No browser is a failure, never a skip: CI installs one."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (tools/test does, as root)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1200, "height": 820})
        try:
            yield ctx
        finally:
            ctx.close()


@pytest.fixture
def page(browser):
    p = browser.new_page()
    p.set_default_timeout(30_000)
    p.dialogs = []  # an alert() from injected markup would land here
    p.on("dialog", lambda d: (p.dialogs.append(d.message), d.dismiss()))
    yield p
    p.close()


def metric(server, name: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def settled(server, before: dict, timeout: float = 10.0) -> dict:
    """The first /stats taken after the requests sent since `before` all ended: the
    counters come with the scheduler's heartbeat (every 0.5 s), not with the reply.
    The wait of more than two heartbeats first is what makes it "after": without it an
    idle heartbeat sent before a short request began still looks settled."""
    time.sleep(1.1)
    deadline = time.time() + timeout
    while time.time() < deadline:
        stats = requests.get(server.url + "/stats", timeout=10).json()
        if stats["steps"] > before["steps"] and stats["running"] == stats["waiting"] == 0:
            return stats
        time.sleep(0.1)
    raise TimeoutError(f"the server did not settle: {stats}")


def open_chat(page, server, temperature="0", max_tokens="400"):
    page.goto(server.url + "/")
    model = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    page.wait_for_function("m => document.getElementById('model').textContent === m", arg=model)
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)


def say(page, text: str) -> dict:
    """Send `text` through the page; wait for the reply; return its text, state and figures."""
    n = page.locator("li.msg.assistant").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    li = page.locator("li.msg.assistant").nth(n)
    page.wait_for_function(
        "n => { const li = document.querySelectorAll('li.msg.assistant')[n];"
        " return li && li.dataset.state && li.dataset.state !== 'streaming'; }", arg=n)
    return {"text": li.locator(".text").text_content(), "meta": li.locator(".meta").text_content(),
            **li.evaluate("li => Object.assign({}, li.dataset)")}


RECORD_GROWTH = """() => {
    // Every change to the newest reply's text, with the reply's state at that moment.
    window.__growth = [];
    new MutationObserver(() => {
        const all = document.querySelectorAll('li.msg.assistant');
        const li = all[all.length - 1];
        if (li) window.__growth.push([li.querySelector('.text').textContent.length, li.dataset.state]);
    }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


# ---- tests -------------------------------------------------------------------------

def test_two_turns_stream_as_text_and_the_second_reports_the_cached_prompt_tokens(page, server, scripted):
    """Fails if the page shows a reply only once it is complete, forgets the first turn,
    shows figures that are not the server's, or lets markup in a reply become elements."""
    open_chat(page, server)
    sent = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    page.evaluate(RECORD_GROWTH)

    first = say(page, FIRST)
    assert first["state"] == "done" and first["text"] == SCRIPT
    streaming = [n for n, state in page.evaluate("window.__growth") if state == "streaming"]
    assert len({n for n in streaming if 0 < n < len(SCRIPT)}) >= 2, f"text did not grow while streaming: {streaming}"

    before = settled(server, {"steps": -1})
    cached_before = metric(server, "ferroxmp_cached_prompt_tokens_total")
    generated_before = metric(server, "ferroxmp_generation_tokens_total")
    second = say(page, SECOND)
    settled(server, before)
    assert second["state"] == "done" and second["text"] == SCRIPT
    cached = int(second["cachedTokens"])
    assert cached > 0
    assert cached == metric(server, "ferroxmp_cached_prompt_tokens_total") - cached_before
    assert int(second["tokens"]) == metric(server, "ferroxmp_generation_tokens_total") - generated_before
    assert f"{cached} of {second['promptTokens']} prompt tokens cached" in second["meta"]
    assert re.search(rf"^{second['tokens']} tokens · [\d.]+ tok/s · TTFT \d+ ms", second["meta"])

    # The page sent the whole conversation, with the sampling settings it shows.
    assert [m["content"] for m in sent[1]["messages"]] == [FIRST, SCRIPT, SECOND]
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
    assert sent[1]["temperature"] == 0 and sent[1]["max_tokens"] == 400
    assert sent[1]["stream"] is True and sent[1]["stream_options"] == {"include_usage": True}
    # The same request straight to the API: the same prompt, the same answer.
    direct = requests.post(server.url + "/v1/chat/completions", timeout=60,
                           json={**sent[1], "stream": False, "stream_options": None}).json()
    assert direct["choices"][0]["message"]["content"] == second["text"]
    assert direct["usage"]["prompt_tokens"] == int(second["promptTokens"])

    # Markup in the replies stayed text: no element came from them, nothing ran.
    assert page.locator("#messages script, #messages img, #messages .text *").count() == 0
    assert page.evaluate("document.scripts.length") == 1
    assert page.dialogs == []

    settled(server, before)  # the panel in the screenshot shows the server at rest
    page.wait_for_function("() => document.getElementById('stat-running').textContent === '0'")
    os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
    page.screenshot(path=SCREENSHOT)


def test_the_max_tokens_setting_cuts_the_reply_where_the_server_does(page, server, scripted):
    """Fails if the page's max tokens is not what the server applies (or is ignored)."""
    open_chat(page, server, max_tokens="5")
    reply = say(page, "A short one, please.")
    _, ids = scripted
    tok = Tokenizer.from_file(os.path.join(scripted[0], "tokenizer.json"))
    assert reply["text"] == tok.decode(ids[:5])
    assert reply["tokens"] == "5" and reply["finishReason"] == "length"
    assert "finish: length" in reply["meta"]


def test_the_server_panel_shows_what_stats_and_metrics_report(page, server):
    """Fails if /stats or the panel disagree with the scheduler's counters on /metrics."""
    stats = settled(server, {"steps": -1})
    open_chat(page, server)
    page.wait_for_function("() => document.getElementById('stats-status').textContent.includes('updated')")
    names = {"pages_total": "kv_pages_total", "pages_free": "kv_pages_free", "pages_cached": "kv_pages_cached",
             "pages_in_use": "kv_pages_in_use", "running": "requests_running", "waiting": "requests_waiting"}
    for field, name in names.items():
        assert stats[field] == metric(server, "ferroxmp_" + name), field
    assert stats["running"] == stats["waiting"] == stats["pages_in_use"] == 0  # idle
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"] == 512
    shown = {f: page.locator(f"#stat-{f.replace('_', '-')}").text_content()
             for f in ("pages_free", "pages_cached", "pages_in_use", "running", "waiting")}
    assert shown == {f: str(stats[f]) for f in shown}


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(page, scripted):
    """Fails if a keyed server's page neither asks for the key nor sends it, or if /stats
    is readable without it."""
    with ServerProcess(scripted[0], *FLAGS, "--api-key", API_KEY) as srv:
        assert requests.get(srv.url + "/stats", timeout=10).status_code == 401
        assert requests.get(srv.url + "/stats", timeout=10,
                            headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert requests.get(srv.url + "/", timeout=10).status_code == 200
        page.goto(srv.url + "/")
        dialog = page.locator("#key-dialog")
        dialog.wait_for(state="visible")
        page.fill("#api-key", "wrong-key")
        page.click("#key-submit")
        page.wait_for_function("() => document.getElementById('key-error').textContent.includes('refused')")
        assert dialog.is_visible()
        page.fill("#api-key", API_KEY)
        page.click("#key-submit")
        page.wait_for_function("() => document.getElementById('model').textContent === 'scripted-model'")
        assert not dialog.is_visible()
        page.fill("#temperature", "0")
        auth = []
        page.on("request", lambda r: auth.append(r.headers.get("authorization"))
                if r.url.endswith("/v1/chat/completions") else None)
        reply = say(page, "hello")
        assert reply["state"] == "done" and reply["text"] == SCRIPT
        assert auth == [f"Bearer {API_KEY}"]
        page.wait_for_function("() => document.getElementById('stats-status').textContent.includes('updated')")
