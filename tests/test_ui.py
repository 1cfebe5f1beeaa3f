"""The page at `/` of `clef-gguf serve`, driven in a real browser: Debian's chromium under Playwright for
Python (pointed at /usr/bin/chromium, no browser download), against one `serve` on loopback of a fixture model with
its vision tower and two adapters, behind --api-key. Every request the browser makes is recorded: none may leave
the server. The screenshots land in SHOTS (build/ is ignored by git)."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from live_server import served
from peft_adapters import peft_adapter
from PIL import Image
from server_helpers import start

import clef_gguf
from clef_gguf.errors import AdapterTooLargeError
from clef_gguf.runtime.catalog import JEV_ALIAS
from clef_gguf.runtime.prompt import MAX_QUESTIONS
from clef_gguf.server.app import check_api_key
from clef_gguf.server.run import settings_app
from clef_gguf.server.ui import CONTENT_SECURITY_POLICY, FILES, LIMITS_ROUTE, UI_DIR, limits
from clef_gguf.settings import API_KEY_ENV, ServeSettings
from clef_gguf.testing.hub import Hub

pytestmark = pytest.mark.slow  # a browser against a served model

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "ui-screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--headless", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
KEY = "ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 120.0
WAIT_MS = 60_000
# The page's first example, as the tests read its answers: each question's options in the order the page shows them.
EXAMPLE = {
    "complaint": ["true", "false"],
    "intent": ["refund", "replacement", "information"],
    "urgency": ["low", "medium", "high"],
}


def _browser_missing() -> str | None:
    if not Path(CHROMIUM).is_file():
        return f"{CHROMIUM} is absent: apt-get install chromium (.ci/run installs it)"
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed: pip install -e '.[test]'"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One browser for the module; requested before the server, so that a machine without one starts no server."""
    missing = _browser_missing()
    if missing:
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def server(ws, tmp_path_factory) -> Iterator[str]:
    """`clef-gguf serve` with --api-key, the vision tower and two adapters: its URL."""
    release, root = ws.release("untied_f32"), tmp_path_factory.mktemp("ui")
    triage, urgency = peft_adapter(release, root, "triage"), peft_adapter(release, root, "urgency", seed=1)
    args = ("--api-key", KEY, "--ctx", "4096", "--mmproj", str(ws.mmproj("untied_f32", "f32")))
    args += ("--adapter", f"triage={triage}", "--adapter", f"urgency={urgency}")
    with served(ws.gguf("untied_f32", "f32"), *args) as (url, _):
        yield url


def api(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/systemone", json=body, headers=AUTH if headers is None else headers, timeout=TIMEOUT)


@dataclass
class Tab:
    """A browser tab on the server's page, recording every request it makes and every script error."""

    page: Any
    url: str
    requests: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def open(self, key: str | None = KEY) -> None:
        self.page.goto(self.url + "/")
        self.page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)
        if key is not None:
            self.page.fill("#key", key)
            self.page.click("#key-form button[type=submit]")
            self.page.wait_for_function("() => document.querySelectorAll('#model option').length === 3", timeout=WAIT_MS)

    def decide(self) -> dict[str, Any]:
        """Click Decide; the body the page sent (read from the browser's own request)."""
        with self.page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/v1/systemone")) as sent:
            self.page.click("#decide")
        self.page.wait_for_function("() => !document.getElementById('decide').disabled", timeout=WAIT_MS)
        return json.loads(sent.value.post_data)

    def shown(self, question: str, option: str, model: str) -> str:
        cell = f'section.answer[data-question="{question}"] tr[data-option="{option}"] td[data-model="{model}"]'
        return self.page.inner_text(f"{cell} .value")

    def top(self, question: str, model: str) -> str:
        rows = self.page.locator(f'section.answer[data-question="{question}"] tr:has(td[data-model="{model}"].top)')
        return rows.get_attribute("data-option")

    def question(self, qid: str) -> Any:
        ids = self.page.locator("li.question input.q-id").evaluate_all("(inputs) => inputs.map((i) => i.value)")
        return self.page.locator("li.question").nth(ids.index(qid))


@pytest.fixture
def tab(browser, server) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server)
    page = context.new_page()
    tab = Tab(page, server)
    context.on("request", lambda r: tab.requests.append(r))
    page.on("pageerror", lambda e: tab.errors.append(str(e)))
    page.on("console", lambda m: tab.errors.append(m.text) if m.type == "error" and "status of" not in m.text else None)
    page.on("dialog", lambda d: tab.errors.append(f"a dialog opened: {d.message}"))
    yield tab
    context.close()
    own = urlsplit(server).netloc
    assert [r.url for r in tab.requests if urlsplit(r.url).netloc != own] == []  # no request to any other host
    assert tab.errors == []  # no script error, no CSP violation, no dialog


def shown_rows(question: str, answer: dict[str, Any]) -> dict[str, str]:
    """What the page must show for an API answer: each option's probability to the 4 decimals the API rounds to."""
    if answer["type"] == "noul":
        return {"true": f"{answer['noul']:.4f}", "false": f"{round(1 - answer['noul'], 4):.4f}"}
    names = EXAMPLE.get(question) or list(answer["probabilities"])
    if answer["type"] == "score":
        return {name: f"{answer['probabilities'][str(i)]:.4f}" for i, name in enumerate(names)}
    return {name: f"{answer['probabilities'][name]:.4f}" for name in names}


def check_shown(tab: Tab, answers: dict[str, Any], model: str) -> None:
    for question, answer in answers.items():
        rows = shown_rows(question, answer)
        assert {name: tab.shown(question, name, model) for name in rows} == rows, (question, model)
        best = max(rows, key=lambda name: float(rows[name]))  # the first maximum, as the page marks it
        assert tab.top(question, model) == best, question


# --- without a browser: the routes, their headers, --no-ui --------------------------------------------------------
def test_the_page_files_need_no_key_and_carry_the_policy(server):
    for route, (name, media_type) in FILES.items():
        response = httpx.get(server + route, timeout=TIMEOUT)  # the server has --api-key: none is sent
        assert response.status_code == 200 and response.content == (UI_DIR / name).read_bytes(), route
        assert response.headers["content-type"] == media_type
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert response.headers["x-content-type-options"] == "nosniff"
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    html = (UI_DIR / "index.html").read_text()
    # No inline script or style to allow: every script is a file, no element has a style or an on* attribute.
    assert "<script>" not in html and "<style" not in html and not re.search(r"\s(style|on[a-z]+)=", html)
    for name in {name for name, _ in FILES.values()} - {"icon.svg"}:
        text = (UI_DIR / name).read_text()
        assert "http://" not in text and "https://" not in text and "innerHTML" not in text, name  # no other host
    assert httpx.get(server + "/v1/models", timeout=TIMEOUT).status_code == 401  # the API still wants the key
    # The page's script is every module served, none more (main.js imports the rest); the limits are the runtime's.
    assert {p.name for p in UI_DIR.glob("*.js")} == {name for name, _ in FILES.values() if name.endswith(".js")}
    assert '<script type="module" src="/ui/main.js">' in html
    numbers = httpx.get(server + LIMITS_ROUTE, timeout=TIMEOUT)
    assert numbers.status_code == 200 and numbers.json() == limits() and numbers.headers["x-content-type-options"] == "nosniff"
    assert limits()["questions"] == MAX_QUESTIONS and limits()["alias"] == JEV_ALIAS


def test_no_ui_leaves_the_page_out(ws):
    """--no-ui (ServeSettings.ui, as `serve` and a Ray ingress build the app: run.settings_app): / is the API's 404."""
    model = ws.model("untied_f32", "f32")
    for ui, status in ((False, 404), (True, 200)):
        live = start(settings_app(model, ServeSettings(ui=ui), owns_model=False))
        try:
            for route in FILES:
                assert httpx.get(live.url + route, timeout=TIMEOUT).status_code == status, (ui, route)
            assert httpx.get(live.url + "/health", timeout=TIMEOUT).status_code == 200
        finally:
            live.stop()
    run = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert "--no-ui" in run.stdout


# --- in the browser -----------------------------------------------------------------------------------------------
def test_without_the_key_the_page_shows_the_401_and_with_it_the_answer(tab):
    refusal = httpx.get(tab.url + "/v1/models", timeout=TIMEOUT).json()["detail"]["message"]
    tab.open(key=None)
    assert tab.page.is_visible("#key-section")
    assert tab.page.inner_text("#key-error") == refusal
    tab.decide()  # the base is known from /health: the decision is refused with the server's message
    assert tab.page.inner_text("#form-error") == refusal
    tab.page.fill("#key", KEY)
    tab.page.click("#key-form button[type=submit]")
    tab.page.wait_for_selector("#key-section", state="hidden", timeout=WAIT_MS)
    body = tab.decide()
    want = api(tab.url, body).json()
    check_shown(tab, want["answers"], body["model"])
    # The key is in the tab's session storage, nowhere else.
    assert tab.page.evaluate("sessionStorage.getItem('clef-gguf-api-key')") == KEY
    assert tab.page.evaluate("localStorage.length") == 0 and tab.page.context.cookies() == []


def test_a_decision_shows_what_the_api_answers_for_the_same_body(tab):
    tab.open()
    # A fourth question built with the page's controls: a choice of three options, one described, one removed.
    tab.page.select_option("#new-type", "choice")
    tab.page.click("#add-question")
    added = tab.page.locator("li.question").last
    added.locator("input.q-id").fill("team")
    added.locator("textarea.q-instructions").fill("Which team should answer?")
    added.locator("button.opt-add").click()
    added.locator("button.opt-add").click()
    names = added.locator("input.opt-name")
    for i, name in enumerate(["billing", "shipping", "drop me", "other"]):
        names.nth(i).fill(name)
    added.locator("input.opt-description").first.fill("Charges and refunds")
    added.locator("li.option").nth(2).locator("button.opt-remove").click()
    body = tab.decide()
    assert body["model"] == tab.page.input_value("#model") and body["state"] == tab.page.input_value("#state")
    assert body["questions"]["team"] == {
        "type": "choice",
        "instructions": "Which team should answer?",
        "criteria": {"billing": "Charges and refunds", "shipping": None, "other": None},
    }
    assert list(body["questions"]) == ["complaint", "intent", "urgency", "team"]
    want = api(tab.url, body)
    assert want.status_code == 200, want.text
    order = {**EXAMPLE, "team": ["billing", "shipping", "other"]}
    for question in want.json()["answers"]:
        names = order[question]
        rows = tab.page.locator(f'section.answer[data-question="{question}"] tbody th')
        assert rows.all_inner_texts() == names, question  # in the question's order
    check_shown(tab, {q: a for q, a in want.json()["answers"].items() if q != "team"}, body["model"])
    team = want.json()["answers"]["team"]["probabilities"]
    assert {n: tab.shown("team", n, body["model"]) for n in team} == {n: f"{p:.4f}" for n, p in team.items()}
    usage = tab.page.locator(f'.usage-group[data-model="{body["model"]}"]')
    assert usage.locator("dd[data-usage=input]").inner_text() == str(want.json()["usage"]["input_tokens"])
    assert usage.locator("dd[data-usage=cached]").inner_text().isdigit()
    assert " ms (read " in usage.locator("dd[data-usage=time]").inner_text()  # from Server-Timing
    assert json.loads(tab.page.inner_text("#code-json")) == body


def test_compare_shows_each_models_own_answers_at_both_widths(tab):
    tab.open()
    tab.page.select_option("#model", index=0)  # the base
    tab.page.check("#compare-on")
    tab.page.select_option("#model-b", "triage")
    base = tab.page.input_value("#model")
    body = tab.decide()
    answers = {m: api(tab.url, {**body, "model": m}).json()["answers"] for m in (base, "triage")}
    assert answers[base] != answers["triage"]  # the fine-tune answers otherwise
    for model in (base, "triage"):
        check_shown(tab, answers[model], model)
    for question, options in EXAMPLE.items():
        rows = {m: shown_rows(question, answers[m][question]) for m in answers}
        change = {o: round(abs(float(rows["triage"][o]) - float(rows[base][o])), 4) for o in options}
        marked = tab.page.locator(f'section.answer[data-question="{question}"] tr.largest')
        assert marked.get_attribute("data-option") == max(change, key=change.__getitem__), question  # the first largest
    SHOTS.mkdir(parents=True, exist_ok=True)
    for width, height in ((1280, 900), (390, 844)):
        tab.page.set_viewport_size({"width": width, "height": height})
        tab.page.evaluate("window.scrollTo(0, 0)")
        tab.page.screenshot(path=SHOTS / f"compare-{width}.png", full_page=width < 1000)
        assert tab.page.evaluate("document.documentElement.scrollWidth") <= width  # readable: no sideways scrolling


def test_each_model_shows_its_state_and_an_adapter_asked_is_resident_after(tab):
    """Next to each model, its state as /v1/models says it (the base's name says base); after a decision with an
    adapter, that adapter is resident (the page reads the states again after each decision)."""
    tab.open()
    models = httpx.get(tab.url + "/v1/models", headers=AUTH, timeout=TIMEOUT).json()["models"]
    listed = {m["name"]: m["state"] for m in models}
    words = {"resident": "resident", "on_disk": "on disk"}
    shown = tab.page.locator("#model option").evaluate_all("(os) => os.map((o) => [o.value, o.dataset.state, o.text])")
    assert len(shown) == 3 and all(state == listed[name] for name, state, _ in shown), (shown, listed)
    assert all(text == f"{name} (base)" or text == f"{name} · {words[state]}" for name, state, text in shown), shown
    tab.page.select_option("#model", "urgency")
    tab.decide()
    urgency = "document.querySelector('#model option[value=urgency]')"
    tab.page.wait_for_function(f"() => {urgency}.dataset.state === 'resident'", timeout=WAIT_MS)
    assert tab.page.evaluate(f"{urgency}.text") == "urgency · resident"
    assert tab.page.input_value("#model") == "urgency"  # the choice kept when the list is read again


def test_refusals_show_the_servers_message_next_to_the_field(tab):
    tab.open()
    intent = tab.question("intent")
    for _ in range(2):  # one option left: the API wants 2 to 255
        intent.locator("button.opt-remove").first.click()
    body = tab.decide()
    detail = api(tab.url, body).json()["detail"][0]
    line = f"{'.'.join(map(str, detail['loc'][1:]))}: {detail['msg']}"
    assert intent.locator(".q-error").inner_text() == line
    assert intent.locator("input.q-id").get_attribute("aria-invalid") == "true"
    assert tab.page.inner_text("#form-error") == line
    assert tab.page.locator("#results section.answer").count() == 0
    tab.page.click("#load-example")
    tab.page.fill("#state", "word " * 6000)  # over --ctx 4096: 413
    body = tab.decide()
    refused = api(tab.url, body)
    assert refused.status_code == 413
    assert tab.page.inner_text("#form-error") == refused.json()["detail"]["message"]


def test_a_hostile_state_and_names_are_shown_as_text_and_run_nothing(tab):
    tab.open()
    hostile = "<img src=x onerror=\"window.pwned='img'\"><script>window.pwned='script'</script>"
    tab.page.fill("#state", hostile)
    tab.question("complaint").locator("input.q-id").fill("<img src=x onerror=\"window.pwned='id'\">")
    tab.question("intent").locator("input.opt-name").first.fill("<script>window.pwned='option'</script>")
    body = tab.decide()
    assert body["state"] == hostile
    answers = api(tab.url, body).json()["answers"]
    assert tab.page.evaluate("window.pwned") is None
    assert tab.page.evaluate("document.querySelectorAll('img').length") == 0
    assert tab.page.evaluate("document.scripts.length") == 1  # main.js (its modules are imported, not script elements)
    headings = tab.page.locator("#results h3").all_inner_texts()
    assert headings[0].startswith("<img src=x onerror=")
    assert tab.page.locator("#results th[scope=row]", has_text="<script>window.pwned='option'</script>").count() == 1
    assert "<img src=x onerror=" in tab.page.inner_text("#code-curl")  # (JSON in shell quotes: escaped, as text)
    assert json.loads(tab.page.inner_text("#code-json"))["state"] == hostile
    assert len(answers) == 3 and not [r.url for r in tab.requests if urlsplit(r.url).path.endswith("/x")]


def test_the_copied_curl_and_python_get_the_same_answer(tab):
    tab.open()
    tab.page.select_option("#model", "urgency")
    body = tab.decide()
    want = api(tab.url, body).json()
    env = {**os.environ, API_KEY_ENV: KEY}
    copied = {}
    for what in ("curl", "python"):
        tab.page.click(f'[data-copy="code-{what}"]')
        tab.page.wait_for_function("() => document.getElementById('copied').textContent === 'Copied.'", timeout=WAIT_MS)
        copied[what] = tab.page.evaluate("navigator.clipboard.readText()")
        tab.page.evaluate("document.getElementById('copied').textContent = ''")
    curl = subprocess.run(["bash", "-c", copied["curl"]], capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert curl.returncode == 0, curl.stderr
    assert json.loads(curl.stdout)["answers"] == want["answers"] and json.loads(curl.stdout)["model"] == "urgency"
    python = subprocess.run([sys.executable, "-c", copied["python"]], capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert python.returncode == 0, python.stderr
    got = json.loads(python.stdout)
    assert got["model"] == "urgency" and got["answers"] == want["answers"]


def test_images_dropped_on_the_page_reach_the_model(tab):
    tab.open()
    assert tab.page.is_visible("#drop")  # /health says images are on
    png = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 40, 40)).save(png, "PNG")
    drop = """([data, name]) => {
        const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
        const files = new DataTransfer();
        files.items.add(new File([bytes], name, { type: "image/png" }));
        const event = new DragEvent("drop", { dataTransfer: files, bubbles: true, cancelable: true });
        document.getElementById("drop").dispatchEvent(event);
    }"""
    tab.page.evaluate(drop, [base64.b64encode(png.getvalue()).decode(), "red.png"])
    tab.page.wait_for_selector("#image-list li", timeout=WAIT_MS)
    tab.page.wait_for_timeout(200)  # the FileReader's data URL
    body = tab.decide()
    assert body["images"] == ["data:image/png;base64," + base64.b64encode(png.getvalue()).decode()]
    want = api(tab.url, body).json()
    without = api(tab.url, {k: v for k, v in body.items() if k != "images"}).json()
    assert want["usage"]["input_tokens"] > without["usage"]["input_tokens"]  # the image's tokens
    check_shown(tab, want["answers"], body["model"])


def test_every_control_is_labelled_and_the_page_works_from_the_keyboard(tab):
    tab.open()
    unlabelled = tab.page.evaluate(
        """[...document.querySelectorAll('input, select, textarea, button')]
            .filter((e) => !e.closest('[hidden]') && !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                           && !(e.tagName === 'BUTTON' && e.textContent.trim()))
            .map((e) => e.outerHTML)"""
    )
    assert unlabelled == []
    tab.page.focus("#state")
    tab.page.keyboard.press("Tab")  # from the state onwards, into the first question's id
    assert tab.page.evaluate("document.activeElement.classList.contains('q-id')")
    tab.page.focus("#decide")
    with tab.page.expect_response(lambda r: r.url.endswith("/v1/systemone")):
        tab.page.keyboard.press("Enter")
    tab.page.wait_for_selector("#results section.answer", timeout=WAIT_MS)


def test_without_a_vision_tower_the_page_says_why_it_takes_no_images(browser, ws):
    """A server without --mmproj (in this process, no key): no drop zone, and the page says how to add the tower."""
    live = start(settings_app(ws.model("untied_f32", "f32"), ServeSettings(), owns_model=False))
    context = browser.new_context(viewport={"width": 390, "height": 844})
    try:
        page = context.new_page()
        page.goto(live.url + "/")
        page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)
        assert page.is_hidden("#drop") and page.is_hidden("#key-section")  # no key asked: the server has none
        assert "no vision tower" in page.inner_text("#images-note") and "--mmproj" in page.inner_text("#images-note")
    finally:
        context.close()
        live.stop()


# --- what the page refuses itself, and a long form ---------------------------------------------------------------------
def _server_says_of(key: str) -> str:
    with pytest.raises(ValueError) as refused:
        check_api_key(key)
    return str(refused.value)


def test_a_key_the_browser_cannot_send_is_refused_at_the_form_and_never_stored(tab):
    tab.open(key=None)
    for bad in ("cl\u00e9-\u0151", "has space", "key\U0001f511"):  # Latin-1, then beyond it: fetch cannot send either
        tab.page.fill("#key", bad)
        tab.page.click("#key-form button[type=submit]")
        assert tab.page.inner_text("#key-error") == _server_says_of(bad), bad  # the server's own words
        assert tab.page.get_attribute("#key", "aria-invalid") == "true"
        assert tab.page.evaluate("sessionStorage.getItem('clef-gguf-api-key')") is None
    # A key an older page stored: dropped, and the page starts and asks for one (it stayed at "Connecting..." before).
    tab.page.evaluate("sessionStorage.setItem('clef-gguf-api-key', 'cl\u0151')")
    tab.page.reload()
    tab.page.wait_for_selector("body[data-ready=true]", timeout=WAIT_MS)
    assert tab.page.evaluate("sessionStorage.getItem('clef-gguf-api-key')") is None
    assert tab.page.is_visible("#key-section") and tab.page.inner_text("#server").startswith("Serving ")
    tab.page.fill("#key", KEY)
    tab.page.click("#key-form button[type=submit]")
    tab.page.wait_for_function("() => document.querySelectorAll('#model option').length === 3", timeout=WAIT_MS)


def _posts(tab: Tab) -> int:
    return sum(1 for r in tab.requests if r.method == "POST")


def test_duplicate_option_names_are_refused_at_the_field_as_the_server_would(tab):
    tab.open()
    intent = tab.question("intent")
    names = intent.locator("input.opt-name")
    names.nth(1).fill("refund")  # "refund" twice: one key of the criteria object, two rows
    sent = _posts(tab)
    tab.page.click("#decide")
    twice = 'questions.intent.criteria: the option "refund" is named twice; each option needs a name of its own'
    assert intent.locator(".q-error").inner_text() == twice and tab.page.inner_text("#form-error") == twice
    assert names.nth(1).get_attribute("aria-invalid") == "true" and _posts(tab) == sent  # nothing sent
    names.nth(1).fill("")
    tab.page.click("#decide")
    empty = intent.locator(".q-error").inner_text()
    body = {"state": "s", "questions": {"intent": {"type": "choice", "criteria": {"refund": None, "": None}}}}
    detail = api(tab.url, body).json()["detail"][0]
    assert empty == f"{'.'.join(detail['loc'][1:])}: {detail['msg']}"  # the server's line for the same form
    assert _posts(tab) == sent
    names.nth(1).fill("replacement")
    assert set(tab.decide()["questions"]["intent"]["criteria"]) == {"refund", "replacement", "information"}


def test_compare_with_never_preselects_the_model_already_chosen(tab):
    tab.open(key=None)  # before the key only the base is known
    tab.page.fill("#key", KEY)
    tab.page.click("#key-form button[type=submit]")
    tab.page.wait_for_function("() => document.querySelectorAll('#model option').length === 3", timeout=WAIT_MS)
    assert tab.page.input_value("#model-b") != tab.page.input_value("#model")
    tab.page.select_option("#model", tab.page.input_value("#model-b"))
    assert tab.page.input_value("#model-b") != tab.page.input_value("#model")


def test_on_a_long_form_decide_stays_in_view_and_ctrl_enter_decides(tab):
    tab.open()
    for _ in range(12):
        tab.page.select_option("#new-type", "choice")
        tab.page.click("#add-question")
    for width, height in ((1280, 900), (390, 844)):
        tab.page.set_viewport_size({"width": width, "height": height})
        assert tab.page.evaluate("document.documentElement.scrollHeight") > 3 * height  # a long form
        for at in ("0", "document.documentElement.scrollHeight / 2"):
            tab.page.evaluate(f"window.scrollTo(0, {at})")
            box = tab.page.locator("#decide").bounding_box()
            assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= height, (width, at, box)
    tab.page.evaluate("window.scrollTo(0, 0)")
    tab.page.focus("#state")
    with tab.page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/v1/systemone")) as sent:
        tab.page.keyboard.press("Control+Enter")
    assert len(json.loads(sent.value.post_data)["questions"]) == 15
    tab.page.wait_for_selector("#results section.answer", timeout=WAIT_MS)


# --- a server with adapter sources (serve --adapter-source hf://acme, against the Hub stand-in) ------------------------
# The page says which names it may fetch; the user types one beside the list and decides with it; its first use says it
# is being fetched while the request waits; a source that cannot deliver now is the server's 503 with its Retry-After.
@pytest.fixture(scope="module")
def hub(ws, tmp_path_factory) -> Iterator[Hub]:
    """The Hub stand-in with one adapter file, acme/tune-gguf."""
    root = tmp_path_factory.mktemp("ui-hub")
    stand_in = Hub(root / "hub")
    adapter = peft_adapter(ws.release("untied_f32"), root / "tunes", "tune")
    shutil.copyfile(adapter, stand_in.repo("acme", "tune-gguf") / "tune.adapter.gguf")
    yield stand_in
    stand_in.close()


@pytest.fixture
def source_tab(browser, hub, ws, tmp_path, monkeypatch) -> Iterator[Tab]:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    model = clef_gguf.load(
        ws.gguf("untied_f32", "f32"),
        max_prompt_tokens=4096,
        adapter_sources=["hf://acme"],
        adapter_cache=tmp_path / "cache",
        adapter_base_release=ws.release("untied_f32"),
    )
    live = start(settings_app(model, ServeSettings(), owns_model=False))
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = Tab(context.new_page(), live.url)
    tab.page.on("pageerror", lambda e: tab.errors.append(str(e)))
    tab.page.on("console", lambda m: tab.errors.append(m.text) if m.type == "error" and "status of" not in m.text else None)
    try:
        yield tab
    finally:
        hub.gate.set()
        context.close()
        live.stop()
        model.close()
    assert tab.errors == []


def _decide_typed(tab: Tab, name: str) -> dict[str, Any]:
    """Type `name` beside the list and click Decide; the body the page sent, once it was sent."""
    tab.page.fill("#model-source", name)
    with tab.page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/v1/systemone")) as sent:
        tab.page.click("#decide")
    return json.loads(sent.value.post_data)


def _decided(tab: Tab) -> None:
    tab.page.wait_for_function("() => !document.getElementById('decide').disabled", timeout=WAIT_MS)


def test_an_adapter_typed_from_a_source_is_fetched_on_first_use_and_decides(source_tab, hub, tmp_path):
    tab = source_tab
    limits = httpx.get(f"{tab.url}/ui/limits.json", timeout=TIMEOUT).json()
    assert limits["sources"] == ["acme"] and str(tmp_path) not in json.dumps(limits)  # names, never a path or a token
    tab.open(key=None)
    assert tab.page.is_visible("#model-source") and tab.page.inner_text("#source-names") == "acme/REPO[@REVISION]"
    hub.gate.clear()  # the Hub holds its answers: the first use waits, and the page says why
    body = _decide_typed(tab, "acme/tune-gguf")
    assert body["model"] == "acme/tune-gguf"
    tab.page.wait_for_function("() => document.getElementById('busy').textContent.startsWith('Fetching')", timeout=WAIT_MS)
    assert tab.page.inner_text("#busy") == "Fetching acme/tune-gguf for its first use, then deciding… (the request waits)"
    assert tab.page.is_disabled("#decide")
    hub.gate.set()
    _decided(tab)
    want = httpx.post(f"{tab.url}/v1/systemone", json=body, timeout=TIMEOUT)
    assert want.status_code == 200 and want.json()["model"] == "acme/tune-gguf", want.text
    check_shown(tab, want.json()["answers"], "acme/tune-gguf")  # the fine-tune's own answers, as the API gives them
    option = "document.querySelector('#model option[value=\"acme/tune-gguf\"]')"
    tab.page.wait_for_function(f"() => {option} !== null && {option}.dataset.state === 'resident'", timeout=WAIT_MS)
    _decide_typed(tab, "acme/tune-gguf")  # listed now: no fetch to say
    assert tab.page.inner_text("#busy") == "Deciding…"
    _decided(tab)


def test_a_source_that_cannot_deliver_now_shows_the_503_and_when_to_ask_again(source_tab, monkeypatch, tmp_path):
    tab = source_tab
    down = Hub(tmp_path / "down")
    down.close()
    monkeypatch.setenv("HF_ENDPOINT", down.url)  # a Hub that cannot be reached
    tab.open(key=None)
    body = _decide_typed(tab, "acme/tune-gguf")
    _decided(tab)
    refused = httpx.post(f"{tab.url}/v1/systemone", json=body, timeout=TIMEOUT)  # (within the back-off: the same)
    assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
    shown = tab.page.inner_text("#form-error")
    assert shown.startswith(refused.json()["detail"]["message"]) and "cannot deliver acme/tune-gguf now" in shown, shown
    assert shown.endswith(" Ask again in 10 s."), shown
    assert tab.page.locator("#results section.answer").count() == 0


def test_a_restarted_servers_disk_cache_is_listed_with_each_names_state(browser, hub, ws, tmp_path, monkeypatch):
    """After a restart over the same --adapter-cache, the list shows what the cache holds before any request names it:
    an adapter delivered before (on disk), a pinned revision refused for good (refused: not askable, its reason shown)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    with open(hub.repo("acme", "big") / "big.adapter.gguf", "wb") as f:
        f.truncate(2 << 20)  # (over adapter_max_size: refused from the listing's size, never downloaded)
    big = f"acme/big@{hub.sha('acme', 'big')}"
    settings = {
        "max_prompt_tokens": 4096,
        "adapter_sources": ["hf://acme"],
        "adapter_cache": tmp_path / "cache",
        "adapter_base_release": ws.release("untied_f32"),
        "adapter_max_size": 1 << 20,
    }
    request = {"state": "s", "questions": {"q": {"type": "noul"}}}
    with clef_gguf.load(ws.gguf("untied_f32", "f32"), **settings) as first:
        assert first.decide({**request, "model": "acme/tune-gguf"})["model"] == "acme/tune-gguf"
        with pytest.raises(AdapterTooLargeError):
            first.decide({**request, "model": big})
    model = clef_gguf.load(ws.gguf("untied_f32", "f32"), **settings)
    live = start(settings_app(model, ServeSettings(), owns_model=False))
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = Tab(context.new_page(), live.url)
    tab.page.on("pageerror", lambda e: tab.errors.append(str(e)))
    try:
        tab.open(key=None)
        tab.page.wait_for_function("() => document.querySelectorAll('#model option').length === 3", timeout=WAIT_MS)
        read = "(os) => os.map((o) => [o.value, o.dataset.state, o.text, o.disabled, o.title])"
        shown = {o[0]: o[1:] for o in tab.page.locator("#model option").evaluate_all(read)}
    finally:
        context.close()
        live.stop()
        model.close()
    assert shown["acme/tune-gguf"] == ["on_disk", "acme/tune-gguf · on disk", False, ""]
    state, text, disabled, title = shown[big]
    assert (state, text, disabled) == ("refused", f"{big} · refused", True) and "--adapter-max-size" in title, shown
    assert tab.errors == []
