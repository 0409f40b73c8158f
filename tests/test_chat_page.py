"""The chat page at the server's root, driven in a real headless browser: Chromium as Qt WebEngine
ships it in the PyQt6-WebEngine wheel (the test extra), offscreen, against a live server on a tiny
model. Replies are checked against the API's own replies to the same conversation at temperature 0,
the markdown renderer against markdown-it-py's HTML (CommonMark with GitHub's tables), the Python
highlighter against Python's own tokenizer. A screenshot of the page after a streamed reply is
written to the test's folder (its path printed)."""

from __future__ import annotations

import base64
import io
import json
import keyword
import os
import re
import time
import tokenize
from xml.etree import ElementTree

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # read when Qt starts: no display needed
os.environ.setdefault("QTWEBENGINE_DISABLE_SANDBOX", "1")  # Chromium's sandbox refuses to run as root
os.environ.setdefault("QTWEBENGINE_CHROMIUM_FLAGS", "--disable-gpu")

import httpx
import numpy as np
import openai
import pytest
from markdown_it import MarkdownIt
from PIL import Image
from PyQt6 import sip
from PyQt6.QtCore import QEventLoop, QPoint, Qt, QTimer, QUrl
from PyQt6.QtGui import QImage
from PyQt6.QtTest import QTest
from PyQt6.QtWebEngineCore import QWebEnginePage, QWebEngineProfile, QWebEngineSettings
from PyQt6.QtWebEngineWidgets import QWebEngineView
from PyQt6.QtWidgets import QApplication

from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.errors import NO_IMAGES
from hearth.server.app import build_app
from models import make_hf_model
from test_server import serving

API_KEY, NAME = "sk-page", "tiny-page"
PROMPT = "The quick brown fox"


class Page(QWebEnginePage):
    """A page in a fresh in-memory profile (its own localStorage) that keeps the console's errors, says
    yes to every confirm() (the questions asked are kept) and grants the permissions asked (the clipboard)."""

    def __init__(self, profile: QWebEngineProfile) -> None:
        super().__init__(profile)
        self.errors: list[str] = []
        self.confirmed: list[str] = []
        self.settings().setAttribute(QWebEngineSettings.WebAttribute.JavascriptCanAccessClipboard, True)
        self.permissionRequested.connect(lambda permission: permission.grant())

    def chooseFiles(self, mode, old_files, accepted_types):  # noqa: N802 (Qt's name): a file input's dialog
        chosen, self.files_to_choose = getattr(self, "files_to_choose", []), []
        return chosen

    def javaScriptConfirm(self, origin, message):  # noqa: N802 (Qt's name)
        self.confirmed.append(message)
        return True

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

    def click(self, selector: str) -> None:
        """A mouse click in the middle of the element (a user's gesture, as scripts' clicks are not)."""
        x, y = self.js(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                       " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        QTest.mouseClick(self.view.focusProxy(), Qt.MouseButton.LeftButton, pos=QPoint(round(x), round(y)))

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



def stored(browser: Browser, key: str):
    return json.loads(browser.js(f"localStorage.getItem('hearth.{key}')") or "null")


def current(browser: Browser) -> dict:
    chosen = stored(browser, "current")
    return next(c for c in stored(browser, "conversations") if c["id"] == chosen)


def turns(conversation: dict) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in conversation["messages"]]


def press(browser: Browser, where: str, label: str) -> None:
    """Clicks the button that reads `label` inside the element `where` (a CSS selector)."""
    found = browser.js(f"(() => {{ const b = [...document.querySelectorAll({json.dumps(where + ' button')})]"
                       f".find(b => b.textContent === {json.dumps(label)}); b?.click(); return !!b; }})()")
    assert found, f"no {label!r} button in {where}"


def set_value(browser: Browser, element_id: str, value: str, event: str = "change") -> None:
    browser.js(f"(() => {{ const e = document.getElementById({json.dumps(element_id)}); e.value = {json.dumps(value)};"
               f" e.dispatchEvent(new Event({json.dumps(event)})); }})()")


def send(browser: Browser, text: str) -> None:
    set_value(browser, "prompt", text, "input")
    browser.js("document.getElementById('composer').requestSubmit()")


def replied(browser: Browser, count: int) -> None:
    """Waits until the page shows `count` messages and streams no more."""
    browser.until(f"document.getElementById('stop').hidden && !document.querySelector('.streaming')"
                  f" && document.querySelectorAll('#messages .message').length == {count}")


def answer(url: str, messages: list[dict], max_tokens: int):
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=max_tokens, top_p=1)


def test_the_page_its_modules_and_icon_are_served_without_the_key_and_the_api_is_not(served):
    url = served[0]
    for path, kind in (("/", "text/html"), ("/chat.js", "text/javascript"), ("/chat.css", "text/css"),
                       ("/favicon.ico", "image/svg+xml")):
        r = httpx.get(url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.content
    assert ElementTree.fromstring(httpx.get(url + "/favicon.ico").content).tag == "{http://www.w3.org/2000/svg}svg"
    html = httpx.get(url + "/").text
    assert '<link rel="icon" href="/favicon.ico"' in html and "http" not in html  # nothing from elsewhere
    modules, seen = ["chat.js"], set()
    while modules:  # every module chat.js imports, and what they import
        name = modules.pop()
        seen.add(name)
        r = httpx.get(f"{url}/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
        modules += [m for m in re.findall(r'from "\./([\w.]+)"', r.text) if m not in seen]
    assert seen == {"chat.js", "api.js", "markdown.js", "store.js", "syntax.js"}
    assert httpx.get(url + "/v1/models").status_code == 401


def test_the_page_asks_for_the_key_streams_replies_with_their_speed_and_copies_regenerates_and_edits(
        served, browser, tmp_path):
    url = served[0]
    browser.load(url + "/")
    browser.until("!document.getElementById('key-form').hidden")  # /v1/models answered 401
    set_value(browser, "key", API_KEY)
    browser.js("document.getElementById('key-form').requestSubmit()")
    assert browser.until("document.getElementById('model').value") == NAME
    browser.js("document.getElementById('toggle-settings').click()")
    for name, value in (("temperature", "0"), ("system", "You are terse."), ("max_tokens", "40")):
        set_value(browser, name, value)
    send(browser, PROMPT)
    replied(browser, 2)
    system = {"role": "system", "content": "You are terse."}
    reference = answer(url, [system, {"role": "user", "content": PROMPT}], 40)
    conversation = current(browser)
    assert turns(conversation) == [("user", PROMPT), ("assistant", reference.choices[0].message.content)]
    stats = conversation["messages"][1]["stats"]  # the token count is the server's (streamed usage)
    assert stats["tokens"] == reference.usage.completion_tokens and stats["exact"] and not stats["stopped"]
    assert stats["ttft_ms"] >= 0 and stats["tokens_per_s"] > 0
    shown = browser.js("document.querySelector('.message.assistant .stats').textContent")
    assert shown.startswith(f"{stats['tokens']} tokens · ") and f"tokens/s · TTFT {stats['ttft_ms']} ms" in shown
    assert stored(browser, "key") == API_KEY and stored(browser, "setting.temperature") == "0"
    shot = tmp_path / "chat-page.png"
    image = browser.screenshot(shot)
    print(f"screenshot: {shot}")
    assert image.width() == 1000 and len({image.pixel(x, y) for x in range(0, 1000, 25) for y in range(0, 700, 25)}) > 3

    QApplication.clipboard().clear()
    press(browser, ".message.assistant", "Copy")
    browser.until("document.querySelector('.message.assistant .actions button').textContent === 'Copied'")
    assert QApplication.clipboard().text() == reference.choices[0].message.content

    set_value(browser, "max_tokens", "12")  # a regenerated reply follows the settings of now
    press(browser, ".message.assistant", "Regenerate")  # the old reply goes at once, a new one streams
    assert browser.js("document.querySelectorAll('.message').length == 2 && !!document.querySelector('.streaming')")
    replied(browser, 2)
    shorter = answer(url, [system, {"role": "user", "content": PROMPT}], 12).choices[0].message.content
    assert turns(current(browser)) == [("user", PROMPT), ("assistant", shorter)] and shorter != reference

    press(browser, ".message.user", "Edit")
    browser.js("document.querySelector('.message.user textarea.editor').value = 'Once upon a time'")
    press(browser, ".message.user", "Send")
    replied(browser, 2)
    edited = answer(url, [system, {"role": "user", "content": "Once upon a time"}], 12).choices[0].message.content
    assert turns(current(browser)) == [("user", "Once upon a time"), ("assistant", edited)]
    assert len(stored(browser, "conversations")) == 1 and browser.page.errors == []


def test_conversations_are_listed_renamed_kept_after_a_reload_opened_and_deleted(served, browser):
    """Goes on from the conversation the test above left in the browser."""
    url = served[0]
    first = current(browser)  # the one the test above left
    browser.js("document.getElementById('new-chat').click()")
    assert browser.js("document.querySelectorAll('#messages .message').length") == 0
    send(browser, "Hello there")
    replied(browser, 2)
    assert [c["id"] for c in stored(browser, "conversations")][1] == first["id"]  # the newest first
    browser.js(f"document.querySelector('#conversations li[data-id={json.dumps(first['id'])}] .rename').click()")
    browser.js("const i = document.querySelector('.rename-input'); i.value = 'Fox <b>story</b>';"
               "i.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter'}))")
    browser.load(url + "/")
    titles = "[...document.querySelectorAll('#conversations .title')].map(t => t.textContent)"
    assert browser.until(f"{titles}.length == 2 && {titles}") == ["Hello there", "Fox <b>story</b>"]
    assert browser.js("document.querySelector('#conversations li.current .title').textContent") == "Hello there"
    replied(browser, 2)
    browser.js(f"document.querySelector('#conversations li[data-id={json.dumps(first['id'])}] .title').click()")
    assert browser.until("document.querySelector('#messages .message.user .body')?.textContent") == "Once upon a time"
    browser.js("document.querySelector('#conversations li:not(.current) .delete').click()")
    assert browser.page.confirmed == ['Delete "Hello there"?']
    assert [c["id"] for c in stored(browser, "conversations")] == [first["id"]]
    assert browser.js(titles) == ["Fox <b>story</b>"] and browser.page.errors == []


def open_page(browser: Browser, url: str) -> None:
    """The page, with the key, where a test runs alone (otherwise as the tests before left it)."""
    if not browser.page.url().toString().startswith(url):
        browser.load(url + "/")
        browser.js(f"localStorage.setItem('hearth.key', {json.dumps(json.dumps(API_KEY))})")
        browser.load(url + "/")


def test_stop_ends_the_reply_and_the_server_aborts_it(served, browser):
    url, engine, llm_engine = served
    full = answer(url, [{"role": "user", "content": PROMPT}], 400).choices[0].message.content
    assert len(full) > 200  # greedy: a reply long enough to stop in the middle
    step = llm_engine.step
    llm_engine.step = lambda: (time.sleep(0.05), step())[1]  # slow enough to stop mid-reply
    try:
        open_page(browser, url)
        browser.js("document.getElementById('new-chat').click()")
        for name, value in (("max_tokens", "400"), ("temperature", "0"), ("system", "")):
            set_value(browser, name, value)
        send(browser, PROMPT)
        browser.until("document.querySelector('.message.assistant .body')?.textContent.length > 0")
        assert browser.js("!document.getElementById('stop').hidden")  # still streaming
        browser.js("document.getElementById('stop').click()")
        browser.until("document.getElementById('stop').hidden && !document.getElementById('send').hidden", 5)
        deadline = time.monotonic() + 5
        while engine.num_running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.num_running == 0  # the server saw the connection go and aborted the request
        kept = current(browser)["messages"][-1]  # what came before the stop is kept
        assert kept["role"] == "assistant" and 0 < len(kept["content"]) < len(full) and full.startswith(kept["content"])
        assert kept["stats"]["stopped"] and not kept["stats"]["exact"]  # no usage came: the deltas are counted
        assert browser.js("document.querySelector('.message.assistant .stats').textContent").startswith("~")
    finally:
        llm_engine.step = step
    assert browser.page.errors == []


MARKDOWN = [  # each rendered by the page and by markdown-it-py, their DOM compared
    "# Title\nSome **bold**, *it*, ~~gone~~, `x < y`, snake_case_name, 2 * 3 * 4 and [a link](https://example.com)",
    "1. one\n2. two\n   - nested\n     - deeper\n   - again\n3. three\n\n---\n5. five\n6. six",
    "- loose\n\n- list\n\n  with a second paragraph\n- end",
    "> a quote with **bold**\n> > nested quote\n> - and a list\n>\n> last line",
    "| Name | Left | Right | Mid |\n|------|:-----|------:|:---:|\n| a | `b` | **c** | d |\n| e \\| f | <i>g</i> | h | |",
    "Text\n```python\ndef f(x):\n    return x < 1\n```\n~~~\nplain <b>\n~~~",
    "line one\nline two\n\n* star\n+ plus",
    "## Steps ##\n1. Install:\n   ```bash\n   pip install hearth  # here\n   ```\n2. Run `hearth serve`\n   > a note\n\n***",
    "- a\n    - four spaces\n        - eight\n- b\n\nAfter **the list**: __strong__ _em_ and ~~s~~.",
]
SHAPE_JS = """(html) => {
  const shape = (node) => {
    if (node.nodeType === Node.TEXT_NODE) return node.textContent.trim();
    const tag = node.tagName.toLowerCase();
    if (tag === "code" && node.parentNode.tagName === "PRE") return [tag, node.className, node.textContent.replace(/\\n$/, "")];
    const attributes = Object.fromEntries(["href", "start"].filter((a) => node.hasAttribute(a))
      .map((a) => [a, node.getAttribute(a)]).concat(node.style.textAlign ? [["align", node.style.textAlign]] : []));
    return [tag, attributes, ...[...node.childNodes].map(shape).filter((kid) => kid !== "")];
  };
  return shape(new DOMParser().parseFromString(html, "text/html").body);
}"""
EVIL = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'


def python_tokens(code: str) -> list[list[str]]:
    """What Python's tokenizer calls comments, strings, numbers and keywords in `code`, in order."""
    kinds = {tokenize.COMMENT: "comment", tokenize.STRING: "string", tokenize.NUMBER: "number"}
    words = set(keyword.kwlist) | {"match", "case"}
    return [[f"tok-{'keyword' if t.type == tokenize.NAME else kinds[t.type]}", t.string]
            for t in tokenize.generate_tokens(io.StringIO(code).readline)
            if t.type in kinds or (t.type == tokenize.NAME and t.string in words)]


def test_markdown_highlighting_escaping_reasoning_dark_mode_and_icon(served, browser):
    url = served[0]
    hostile = [{"role": "user", "content": EVIL},
               {"role": "assistant", "content": f"{EVIL}\n\n| a |\n|---|\n| {EVIL} |\n\n> {EVIL}\n\n- {EVIL}\n"
                "[x](javascript:window.pwned=3) [y](https://ok\"onmouseover=\"window.pwned=4)\n\n```html\n" + EVIL + "\n```",
                "reasoning": f"Thinking about {EVIL}"}]
    browser.load(url + "/")  # the server's origin, whose storage the page reads
    browser.js("localStorage.setItem('hearth.conversations', " + json.dumps(json.dumps(
        [{"id": "evil", "title": EVIL, "messages": hostile, "updated": 0}])) + "); localStorage.setItem('hearth.current', '\"evil\"');"
        "localStorage.removeItem('hearth.theme')")
    browser.load(url + "/")
    browser.until("document.querySelectorAll('#messages .message').length == 2")
    browser.js("import(location.origin + '/markdown.js').then((m) => { window.markdown = m; });"
               "const icon = new Image(); icon.onload = () => { window.iconWidth = icon.naturalWidth; };"
               "icon.src = document.querySelector('link[rel=icon]').href;")
    browser.until("window.markdown && window.iconWidth")  # the browser shows /favicon.ico as an image
    # hostile text in a title, a message, a reply (table, quote, list, links) and its reasoning shows as text
    injected = browser.js("document.querySelectorAll('#sidebar img, #sidebar script, #messages img, #messages script,"
                          " #messages [onmouseover], #messages a[href^=javascript]').length")
    assert injected == 0 and browser.js("window.pwned") is None
    assert EVIL in browser.js("document.querySelector('#conversations .title').textContent")
    assert EVIL in browser.js("document.querySelector('.message.user .body').textContent")
    assert browser.js("document.querySelector('.message.assistant td').textContent") == EVIL
    assert browser.js("document.querySelector('.message.assistant .reasoning').open") is False  # collapsed
    QApplication.clipboard().clear()
    press(browser, ".message.assistant pre", "Copy")  # a code block's own button copies its code
    browser.until("document.querySelector('.message.assistant pre button').textContent === 'Copied'")
    assert QApplication.clipboard().text() == EVIL
    assert EVIL in browser.js("document.querySelector('.message.assistant .reasoning-body').textContent")
    engine = MarkdownIt("commonmark", {"breaks": True, "html": False}).enable(["table", "strikethrough"])
    for source in MARKDOWN:
        expected = browser.js(f"({SHAPE_JS})({json.dumps(engine.render(source))})")
        got = browser.js(f"({SHAPE_JS})(window.markdown.renderMarkdown({json.dumps(source)}))")
        assert got == expected, source
    code = "def f(x=0x1F):  # a comment\n    return 'it\\'s' + \"\"\"doc\"\"\" if x is not None else 2.5e3\n"
    spans = browser.js(f"[...new DOMParser().parseFromString(window.markdown.renderMarkdown("
                       f"{json.dumps('```py' + chr(10) + code + '```')}), 'text/html').querySelectorAll('pre span')]"
                       ".map((s) => [s.className, s.textContent])")
    assert spans == python_tokens(code)
    check_a_streamed_reasoning_reply(browser)
    check_dark_mode(browser, url)
    assert browser.page.errors == []


def check_a_streamed_reasoning_reply(browser: Browser) -> None:
    """Until the server splits reasoning out (--reasoning-parser), a stream with reasoning_content deltas
    is played to the page by a stand-in for fetch: the reasoning shows collapsed, apart from the reply."""
    events = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"reasoning_content": "Hmm, "}}]},
              {"choices": [{"delta": {"reasoning_content": "two *words*."}}]}, {"choices": [{"delta": {"content": "Hi"}}]},
              {"choices": [{"delta": {"content": " there"}}]}, {"choices": [], "usage": {"completion_tokens": 7}}]
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    browser.js("window.sent = []; window.fetch = async (path, init) => { window.sent.push(JSON.parse(init.body));"
               " if (window.sent.length == 1) return Response.json({error: {message: 'no room'}}, {status: 503});"
               f" return new Response({json.dumps(stream)}, {{headers: {{'Content-Type': 'text/event-stream'}}}}); }};"
               "document.getElementById('new-chat').click()")
    send(browser, "Question 1")
    assert browser.until("document.getElementById('error').textContent") == "no room"  # the API's error, shown
    replied(browser, 1)  # the question stays, unanswered: Regenerate answers it
    press(browser, ".message.user", "Regenerate")
    replied(browser, 2)
    send(browser, "Question 2")
    replied(browser, 4)
    reply = current(browser)["messages"][1]
    assert (reply["reasoning"], reply["content"], reply["stats"]["tokens"]) == ("Hmm, two *words*.", "Hi there", 7)
    assert browser.js("document.querySelector('.message.assistant .reasoning').open") is False
    assert browser.js("document.querySelector('.message.assistant .reasoning-body em').textContent") == "words"
    assert browser.js("document.querySelector('.message.assistant .body').textContent") == "Hi there"
    browser.js("window.setItem = Storage.prototype.setItem;"
               "Storage.prototype.setItem = () => { throw new DOMException('the quota is exceeded', 'QuotaExceededError'); }")
    send(browser, "Question 3")
    replied(browser, 6)
    browser.js("Storage.prototype.setItem = window.setItem")
    assert browser.js("document.getElementById('error').textContent") == (
        "This browser did not keep the conversation (the quota is exceeded): delete some.")
    _, first, second, _ = browser.js("window.sent")
    assert first["stream"] and first["stream_options"] == {"include_usage": True}
    assert second["messages"][-3:] == [{"role": "user", "content": "Question 1"},
                                       {"role": "assistant", "content": "Hi there"},  # no reasoning sent back
                                       {"role": "user", "content": "Question 2"}]


def check_dark_mode(browser: Browser, url: str) -> None:
    """The system's scheme (light here) until the toggle; the toggle's choice is kept over a reload."""
    background = "getComputedStyle(document.body).backgroundColor"
    assert browser.js("matchMedia('(prefers-color-scheme: dark)').matches") is False
    assert browser.js(background) == "rgb(250, 250, 250)"
    browser.js("document.getElementById('toggle-theme').click()")
    assert browser.js("document.documentElement.className") == "dark" and stored(browser, "theme") == "dark"
    assert browser.js(background) == "rgb(20, 21, 24)"
    browser.load(url + "/")
    assert browser.js("document.documentElement.className") == "dark" and browser.js(background) == "rgb(20, 21, 24)"
    browser.js("document.getElementById('toggle-theme').click()")
    assert browser.js("document.documentElement.className") == "light" and browser.js(background) == "rgb(250, 250, 250)"


def test_attached_images_show_as_thumbnails_and_go_to_the_server_as_data_urls(served, browser, monkeypatch,
                                                                              tmp_path):
    """Two images attached of three picked with the Image button (one removed) go with the message; the
    server's 400 for a model without vision shows. Told the model reads images, the engine gets both,
    pixel for pixel."""
    url, engine, llm_engine = served
    open_page(browser, url)
    browser.js("document.getElementById('new-chat').click()")
    set_value(browser, "max_tokens", "8")
    arrays = [np.random.default_rng(seed).integers(0, 256, (12 + seed, 20, 3), dtype=np.uint8) for seed in range(3)]
    paths = [tmp_path / f"picture{i}.png" for i in range(3)]
    for array, path in zip(arrays, paths):
        Image.fromarray(array).save(path)
    files = [path.read_bytes() for path in paths]
    for chosen, count in ((paths[:2], 2), (paths[2:], 3)):  # two at once, then one more
        browser.page.files_to_choose = [str(p) for p in chosen]
        browser.click("#attach")  # a user's click: a file dialog opens only for one
        browser.until(f"document.querySelectorAll('#attachments img.thumb').length == {count}")
    assert browser.js("document.getElementById('attach-input').accept").startswith("image/png")
    press(browser, "#attachments .attachment:nth-child(2)", "✕")
    assert browser.js("document.querySelectorAll('#attachments img.thumb').length") == 2
    send(browser, "What is in them?")
    assert NO_IMAGES in browser.until("document.getElementById('error').textContent")
    assert browser.js("document.getElementById('attachments').hidden")  # they went with the message
    message = current(browser)["messages"][0]
    assert message["content"] == "What is in them?"
    assert [base64.b64decode(u.removeprefix("data:image/png;base64,")) for u in message["images"]] == [files[0], files[2]]
    assert browser.js("document.querySelectorAll('.message.user .images img.thumb').length") == 2

    seen = []
    expand = llm_engine.prompt_with_images  # where the engine takes a prompt's images
    monkeypatch.setattr(engine, "accepts_images", True)
    monkeypatch.setattr(llm_engine, "prompt_with_images",
                        lambda prompt, data, settings=None: (seen.append(data), expand(prompt, data, settings))[1])
    press(browser, ".message.user", "Regenerate")  # the unanswered message is sent again
    browser.until("document.getElementById('error').textContent.includes('multi_modal_data')")
    assert [np.asarray(im).tolist() for im in seen[0]["image"]] == [arrays[0].tolist(), arrays[2].tolist()]
    assert browser.page.errors == []
