"""The page of a server with adapter sources (`serve --adapter-source hf://acme`, against the Hub stand-in), driven in
Chromium as tests/test_ui.py drives it: the page says which names it may fetch, the user types one beside the list
and decides with it; its first use says it is being fetched while the request waits, and a source that cannot deliver
now is the server's 503 message with when to ask again (its Retry-After)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from peft_adapters import peft_adapter
from server_helpers import start
from test_ui import CHROMIUM_ARGS, TIMEOUT, WAIT_MS, Tab, browser, check_shown  # noqa: F401 (browser: the fixture)

import clef_gguf
from clef_gguf.server.run import settings_app
from clef_gguf.settings import ServeSettings
from clef_gguf.testing.hub import Hub

pytestmark = pytest.mark.slow  # a browser against a served model fetching its adapters

assert CHROMIUM_ARGS  # (the same browser as test_ui.py's)


@pytest.fixture(scope="module")
def hub(ws, tmp_path_factory) -> Iterator[Hub]:
    root = tmp_path_factory.mktemp("ui-hub")
    stand_in = Hub(root / "hub")
    adapter = peft_adapter(ws.release("untied_f32"), root / "tunes", "tune")
    shutil.copyfile(adapter, stand_in.repo("acme", "tune-gguf") / "tune.adapter.gguf")
    yield stand_in
    stand_in.close()


@pytest.fixture
def tab(browser, hub, ws, tmp_path, monkeypatch) -> Iterator[Tab]:  # noqa: F811 (test_ui's browser fixture)
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


def _done(tab: Tab) -> None:
    tab.page.wait_for_function("() => !document.getElementById('decide').disabled", timeout=WAIT_MS)


def test_an_adapter_typed_from_a_source_is_fetched_on_first_use_and_decides(tab, hub, tmp_path):
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
    _done(tab)
    want = httpx.post(f"{tab.url}/v1/systemone", json=body, timeout=TIMEOUT)
    assert want.status_code == 200 and want.json()["model"] == "acme/tune-gguf", want.text
    check_shown(tab, want.json()["answers"], "acme/tune-gguf")  # the fine-tune's own answers, as the API gives them
    option = "document.querySelector('#model option[value=\"acme/tune-gguf\"]')"
    tab.page.wait_for_function(f"() => {option} !== null && {option}.dataset.state === 'resident'", timeout=WAIT_MS)
    _decide_typed(tab, "acme/tune-gguf")  # listed now: no fetch to say
    assert tab.page.inner_text("#busy") == "Deciding…"
    _done(tab)


def test_a_source_that_cannot_deliver_now_shows_the_503_and_when_to_ask_again(tab, monkeypatch, tmp_path):
    down = Hub(tmp_path / "down")
    down.close()
    monkeypatch.setenv("HF_ENDPOINT", down.url)  # a Hub that cannot be reached
    tab.open(key=None)
    body = _decide_typed(tab, "acme/tune-gguf")
    _done(tab)
    refused = httpx.post(f"{tab.url}/v1/systemone", json=body, timeout=TIMEOUT)  # (within the back-off: the same)
    assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
    shown = tab.page.inner_text("#form-error")
    assert shown.startswith(refused.json()["detail"]["message"]) and "cannot deliver acme/tune-gguf now" in shown, shown
    assert shown.endswith(" Ask again in 10 s."), shown
    assert tab.page.locator("#results section.answer").count() == 0
