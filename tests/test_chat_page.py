"""The chat page at the server's root, driven in a real headless browser: Chromium as Qt WebEngine
ships it in the PyQt6-WebEngine wheel (the test extra), offscreen. A screenshot of the page after
a streamed reply is written to the test's folder (its path printed)."""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # read when Qt starts: no display needed
os.environ.setdefault("QTWEBENGINE_DISABLE_SANDBOX", "1")  # Chromium's sandbox refuses to run as root
os.environ.setdefault("QTWEBENGINE_CHROMIUM_FLAGS", "--disable-gpu")

import httpx
import openai
import pytest
from PyQt6 import sip
from PyQt6.QtCore import QEventLoop, QTimer, QUrl
from PyQt6.QtGui import QImage
from PyQt6.QtWebEngineCore import QWebEnginePage, QWebEngineProfile
from PyQt6.QtWebEngineWidgets import QWebEngineView
from PyQt6.QtWidgets import QApplication

from hearth.config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.server.app import build_app
from models import make_hf_model
from test_server import serving

API_KEY, NAME = "sk-page", "tiny-page"
PROMPT = "The quick brown fox"


class Page(QWebEnginePage):
    """A page in a fresh in-memory profile (its own localStorage) that keeps the console's errors."""

    def __init__(self, profile: QWebEngineProfile) -> None:
        super().__init__(profile)
        self.errors: list[str] = []

    def javaScriptConsoleMessage(self, level, message, line, source):  # noqa: N802 (Qt's name)
        if level == QWebEnginePage.JavaScriptConsoleMessageLevel.ErrorMessageLevel and "401" not in message:
            self.errors.append(f"{source}:{line}: {message}")


class Browser:
    def __init__(self) -> None:
        self.app = QApplication.instance() or QApplication(["hearth-tests"])
        self.profile = QWebEngineProfile()  # no name: off the record
        self.page = Page(self.profile)
        self.view = QWebEngineView()
        self.view.setPage(self.page)
        self.view.resize(1000, 700)
        self.view.show()

    def _wait(self, start, timeout: float) -> list:
        """Run Qt's events until `start`'s callback is called (its arguments) or the timeout."""
        loop, got = QEventLoop(), []
        start(lambda *args: (got.append(args), loop.quit()))
        QTimer.singleShot(int(timeout * 1000), loop.quit)
        loop.exec()
        return got

    def load(self, url: str) -> None:
        loop, loaded = QEventLoop(), []
        connection = self.page.loadFinished.connect(lambda ok: (loaded.append(ok), loop.quit()))
        self.page.load(QUrl(url))
        QTimer.singleShot(30_000, loop.quit)
        loop.exec()
        self.page.loadFinished.disconnect(connection)
        assert loaded == [True], f"{url} did not load"

    def js(self, script: str):
        got = self._wait(lambda done: self.page.runJavaScript(script, 0, done), 10)
        assert got, f"no answer from {script!r}"
        return got[0][0]

    def until(self, script: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(script)
            if value:
                return value
            self._wait(lambda quit: QTimer.singleShot(50, quit), 1)
        raise AssertionError(f"timed out waiting for {script!r}")

    def screenshot(self, path) -> QImage:
        self._wait(lambda done: QTimer.singleShot(300, done), 1)  # the compositor's next frames
        image = self.view.grab().toImage()
        assert image.save(str(path))
        return image

    def close(self) -> None:
        for qt_object in (self.view, self.page, self.profile):  # the profile outlives its page
            sip.delete(qt_object)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = make_hf_model(tmp_path_factory.mktemp("page-model") / "llama", "llama")
    llm_engine = LLMEngine(folder, EngineConfig(), progress=False)
    engine = AsyncEngine(llm_engine)
    with serving(build_app(engine, NAME, api_key=API_KEY)) as url:
        yield url, engine, llm_engine
    engine.shutdown()


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


def test_the_page_and_its_files_are_served_without_the_key_and_the_api_is_not(served):
    url = served[0]
    for path, kind in (("/", "text/html"), ("/chat.js", "text/javascript"), ("/chat.css", "text/css")):
        r = httpx.get(url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.content
    assert httpx.get(url + "/v1/models").status_code == 401


def stored(browser: Browser, key: str):
    return json.loads(browser.js(f"localStorage.getItem('hearth.{key}')") or "null")


def test_the_page_asks_for_the_key_streams_a_reply_and_keeps_the_conversation(served, browser, tmp_path):
    url, _, _ = served
    browser.load(url + "/")
    browser.until("!document.getElementById('key-form').hidden")  # /v1/models answered 401
    browser.js(f"document.getElementById('key').value = {json.dumps(API_KEY)};"
               "document.getElementById('key-form').requestSubmit()")
    assert browser.until("document.getElementById('model').value") == NAME
    browser.js("document.getElementById('toggle-settings').click();"
               "const t = document.getElementById('temperature'); t.value = '0'; t.dispatchEvent(new Event('change'));"
               "const s = document.getElementById('system'); s.value = 'You are terse.'; s.dispatchEvent(new Event('change'));"
               "const m = document.getElementById('max_tokens'); m.value = '40'; m.dispatchEvent(new Event('change'));"
               f"document.getElementById('prompt').value = {json.dumps(PROMPT)};"
               "document.getElementById('composer').requestSubmit()")
    browser.until("document.getElementById('stop').hidden && document.querySelectorAll('.message').length == 2 "
                  "&& document.querySelector('.message.assistant .body').textContent.length > 0")
    messages = stored(browser, "messages")
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    reference = client.chat.completions.create(
        model=NAME, messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}],
        temperature=0, max_tokens=40, top_p=1).choices[0].message.content
    assert messages == [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": reference}]
    assert stored(browser, "key") == API_KEY and stored(browser, "setting.temperature") == "0"
    shot = tmp_path / "chat-page.png"
    image = browser.screenshot(shot)
    print(f"screenshot: {shot}")
    assert image.width() == 1000 and len({image.pixel(x, y) for x in range(0, 1000, 25) for y in range(0, 700, 25)}) > 3
    # a reload shows the same conversation, from the browser's storage
    browser.load(url + "/")
    assert browser.until("document.querySelectorAll('.message').length") == 2
    assert browser.page.errors == []


def test_stop_ends_the_reply_and_the_server_aborts_it(served, browser):
    url, engine, llm_engine = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    full = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}], temperature=0,
                                          max_tokens=400).choices[0].message.content
    assert len(full) > 200  # greedy: a reply long enough to stop in the middle
    step = llm_engine.step
    llm_engine.step = lambda: (time.sleep(0.05), step())[1]  # slow enough to stop mid-reply
    try:
        browser.load(url + "/")
        browser.js(f"localStorage.setItem('hearth.key', {json.dumps(json.dumps(API_KEY))})")
        browser.load(url + "/")
        browser.until("document.getElementById('model').value")  # the stored key is used
        browser.js("document.getElementById('new-chat').click();"
                   "const m = document.getElementById('max_tokens'); m.value = '400'; m.dispatchEvent(new Event('change'));"
                   "const t = document.getElementById('temperature'); t.value = '0'; t.dispatchEvent(new Event('change'));"
                   "const s = document.getElementById('system'); s.value = ''; s.dispatchEvent(new Event('change'));"
                   f"document.getElementById('prompt').value = {json.dumps(PROMPT)};"
                   "document.getElementById('composer').requestSubmit()")
        browser.until("document.querySelector('.message.assistant .body')?.textContent.length > 0")
        assert browser.js("!document.getElementById('stop').hidden")  # still streaming
        browser.js("document.getElementById('stop').click()")
        browser.until("document.getElementById('stop').hidden && !document.getElementById('send').hidden", 5)
        deadline = time.monotonic() + 5
        while engine.num_running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.num_running == 0  # the server saw the connection go and aborted the request
        kept = stored(browser, "messages")[-1]  # what came before the stop is kept
        assert kept["role"] == "assistant" and 0 < len(kept["content"]) < len(full) and full.startswith(kept["content"])
    finally:
        llm_engine.step = step
    assert browser.page.errors == []


def test_markdown_is_rendered_and_html_in_replies_is_escaped(served, browser):
    browser.load(served[0] + "/")
    source = ("# Title\nSome **bold** and `x < y` and [a link](https://example.com) and [bad](javascript:alert(1))\n"
              "<img src=x onerror=alert(1)><script>alert(2)</script>\n\n```python\nif a < b:\n    print('<b>')\n```\n"
              "- one\n- two")
    html = browser.js(f"renderMarkdown({json.dumps(source)})")
    parsed = browser.js(
        "(() => { const d = new DOMParser().parseFromString(" + json.dumps(html) + ", 'text/html');"
        " return {scripts: d.querySelectorAll('script, img').length, links: [...d.querySelectorAll('a')].map(a => a.href),"
        " code: d.querySelector('pre code').textContent, lang: d.querySelector('pre code').className,"
        " h1: d.querySelector('h1').textContent, strong: d.querySelector('strong').textContent,"
        " inline: d.querySelector('p code').textContent, items: d.querySelectorAll('ul li').length,"
        " text: d.body.textContent}; })()")
    assert parsed["scripts"] == 0 and "<script>alert(2)</script>" in parsed["text"]
    assert parsed["links"] == ["https://example.com/"]
    assert parsed["code"] == "if a < b:\n    print('<b>')" and parsed["lang"] == "language-python"
    assert (parsed["h1"], parsed["strong"], parsed["inline"], parsed["items"]) == ("Title", "bold", "x < y", 2)
