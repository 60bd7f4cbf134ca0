"""The playground's chats, markdown and parameters in a real browser: Playwright (Python) driving Debian's
/usr/bin/chromium headless against the real gateway (shared ``gateway`` fixture), fixtures and helpers from
``test_browser_playground``.

Checks: an answer forced by a regex (``structured_outputs``, set in the Parameters panel; Enter sends) to be
a paragraph and a fenced code block renders as a highlighted ``<pre><code>``, the first block keeping its
node while the rest streams; after a reload the chat is in the sidebar, titled by its first message, and
reopens and can be renamed; Regenerate re-sends the conversation and replaces the answer; Edit cuts the conversation after the
edited message and re-sends it; the phone-width drawers open and close. Model text with ``<img onerror>``
(forced by a regex) and a crafted saved chat (``<script>``, ``<svg onload>``, a ``javascript:`` link, a
remote image) render as text, run nothing and fetch nothing; a chat can be deleted; a full localStorage drops
the inspector entries first. "View code" shows the
exact body that Send posts next (curl and OpenAI SDK, the key only as ``$OPENAI_API_KEY``); the model picker
lists ``GET /v1/models``; the Inspect entry holds the body sent, the assembled response (two choices with
logprobs, usage, timings) and the headers; a bad parameter is a 400 naming it. The Inspect button opens the
inspector on the gateway's record. A forced tool call and a JSON-schema answer are shown as such; a schema
that does not parse is refused before sending. Every request the page makes goes to the gateway.

``LLM_GATEWAY_SCREENSHOTS=1`` also writes docs/img/playground.png (1280x800) and
docs/img/playground-phone.png (390x844).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
from test_browser_playground import browser, gw, last_answer, open_playground, page, send, wait_state  # noqa: F401 - fixtures
from test_filters_http import new_tenant

IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
            "required": ["city"],
        },
    },
}
# Fills localStorage to ~40 kB short of its quota, then saves a chat whose inspector entry is larger: the entry
# goes, the chat stays.
STORAGE_FULL = """() => {
  localStorage.removeItem('gw.chats');
  let n = 1 << 22, filler = '';
  for (; n >= 1 << 14; n >>= 1) {
    try { localStorage.setItem('filler', filler + 'x'.repeat(n)); filler += 'x'.repeat(n); } catch (_) {}
  }
  const chat = ChatStore.create();
  chat.messages.push({role: 'user', content: 'kept'},
                     {role: 'assistant', content: 'a', state: 'done', entry: {blob: 'y'.repeat(100000)}});
  const saved = ChatStore.save(chat);
  localStorage.removeItem('filler');
  const back = ChatStore.get(chat.id);
  return {saved, entry: !!back.messages[1].entry, content: back.messages[0].content};
}"""
# Records the answer's first block once a second one follows it (it is final then).
KEEP_FIRST_BLOCK = """() => {
  window.__firstBlock = null;
  new MutationObserver(() => {
    const c = document.querySelector('.msg.assistant:last-child .content');
    if (c && !window.__firstBlock && c.children.length >= 2) window.__firstBlock = c.firstElementChild;
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""
CODE_REGEX = r"Use \*\*add\*\*:\n\n```python\ndef add\(a, b\):\n    return a \+ b\n```"
SHOWCASE_REGEX = (
    r"Here is a function that adds two \*\*numbers\*\*:\n\n```python\ndef add\(a, b\):\n"
    r"    return a \+ b\n```\n\nCall it as `add\(2, 3\)`\."
)
EVIL = "<img src=x onerror=p=1> **b**"  # p: a global the handler would set
FAKE_INSPECTOR = """(() => {
  const fake = {open: (entry) => { window.__entry = entry; }};
  Object.defineProperty(window, 'Inspector', {get: () => fake, set: () => {}, configurable: true});
})();"""


def only_gateway(pg, base_url: str) -> None:
    assert pg.requested and all(u.startswith(base_url + "/") for u in pg.requested), pg.requested


def set_param(pg, name: str, value: str) -> None:
    pg.evaluate("() => { document.getElementById('params').open = true; }")
    if name == "format":
        pg.select_option("#p-format", value)
    else:
        pg.fill(f"#p-{name}", value)
    pg.dispatch_event(f"#p-{name}", "change")


def posted_bodies(pg) -> list[dict]:
    return [json.loads(b) for b in pg.posted]


def record_posts(pg) -> None:
    """Keeps the JSON bodies of POST /v1/chat/completions in ``pg.posted``."""
    pg.posted = []
    pg.on(
        "request",
        lambda r: (
            pg.posted.append(r.post_data)
            if r.method == "POST" and r.url.endswith("/v1/chat/completions")
            else None
        ),
    )


def test_markdown_saved_chat_regenerate_edit(gw, page):  # noqa: F811 - fixtures
    record_posts(page)
    _, key = new_tenant(gw, "chats")
    open_playground(page, gw.base_url, key, max_tokens=40)
    set_param(page, "format", "regex")
    set_param(page, "format-spec", CODE_REGEX)
    page.evaluate(KEEP_FIRST_BLOCK)
    page.fill("#prompt", "Show me a Python add function.")
    page.press("#prompt", "Enter")  # Enter sends
    assert wait_state(page, "done", "error") == "done", last_answer(page).inner_text()
    code = last_answer(page).locator(".content pre code.language-python")
    assert "return a + b" in code.inner_text()
    assert code.locator("span.hljs-keyword").count() >= 2  # def, return: highlighted
    assert last_answer(page).locator(".content strong").inner_text() == "add"
    # the first paragraph, once followed by another block, kept its node while the rest streamed
    assert page.evaluate(
        "() => !!window.__firstBlock && window.__firstBlock === "
        "document.querySelector('.msg.assistant:last-child .content').firstElementChild"
    )
    first = posted_bodies(page)[-1]
    assert first["structured_outputs"] == {"regex": CODE_REGEX}

    page.reload()
    item = page.locator("#chat-list li", has_text="Show me a Python add function.")
    assert item.count() == 1 and item.get_attribute("aria-current") == "true"
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    item.locator(".chat-open").click()
    assert page.locator(".msg").count() == 2
    assert "return a + b" in last_answer(page).locator("pre").inner_text()

    page.wait_for_function("() => document.getElementById('model').value !== ''")
    set_param(page, "format", "text")  # free text from here on (constrained decoding is slower)
    page.fill("#max-tokens", "6")
    last_answer(page).locator("button.regenerate").click()
    assert wait_state(page, "done", "error") == "done"
    assert page.locator(".msg").count() == 2 and len(page.posted) == 2
    again = posted_bodies(page)[-1]
    assert again["messages"] == first["messages"] and "structured_outputs" not in again

    page.locator(".msg.user button.edit").click()
    page.fill(".msg.user textarea.edit-box", "Show me an add function, please.")
    page.click(".msg.user button.save-edit")
    assert wait_state(page, "done", "error") == "done"
    assert page.locator(".msg").count() == 2
    assert posted_bodies(page)[-1]["messages"] == [
        {"role": "user", "content": "Show me an add function, please."}
    ]
    assert page.locator("#chat-list li[aria-current=true]").inner_text().startswith("Show me an add function")
    page.click("#chat-list li[aria-current=true] .chat-rename")
    page.fill("#chat-list input.chat-title", "Adding")
    page.press("#chat-list input.chat-title", "Enter")
    page.reload()
    assert page.locator("#chat-list li[aria-current=true] .chat-open").inner_text() == "Adding"
    # phone width: the chats and the settings are drawers behind two header buttons
    page.set_viewport_size({"width": 390, "height": 844})
    assert not page.is_visible("#settings") and not page.is_visible("#chats")
    page.click("#toggle-settings")
    assert (
        page.is_visible("#max-tokens") and page.get_attribute("#toggle-settings", "aria-expanded") == "true"
    )
    page.click("#toggle-settings")
    page.click("#toggle-chats")
    assert page.is_visible("#chat-list li[aria-current=true]")
    page.click("#toggle-chats")
    page.set_viewport_size({"width": 1280, "height": 720})
    only_gateway(page, gw.base_url)

    if os.environ.get("LLM_GATEWAY_SCREENSHOTS") == "1":
        screenshots(page)


def screenshots(pg) -> None:
    """docs/img/playground.png (1280x800) and playground-phone.png (390x844): a second chat whose answer
    is forced (regex) into markdown with a code block, the Parameters panel open."""
    IMG.mkdir(parents=True, exist_ok=True)
    pg.set_viewport_size({"width": 1280, "height": 800})
    pg.click("#new-chat")
    pg.fill("#max-tokens", "64")
    set_param(pg, "top_k", "40")
    set_param(pg, "format", "regex")
    set_param(pg, "format-spec", SHOWCASE_REGEX)
    send(pg, "Write a Python function that adds two numbers.")
    assert wait_state(pg, "done", "error") == "done", last_answer(pg).inner_text()
    pg.evaluate("() => { document.getElementById('settings').scrollTop = 0; }")
    pg.screenshot(path=str(IMG / "playground.png"))
    pg.set_viewport_size({"width": 390, "height": 844})
    pg.screenshot(path=str(IMG / "playground-phone.png"))
    pg.set_viewport_size({"width": 1280, "height": 720})


def test_model_html_is_text(gw, page):  # noqa: F811 - fixtures
    record_posts(page)
    _, key = new_tenant(gw, "xss")
    open_playground(page, gw.base_url, key, max_tokens=24)
    set_param(page, "format", "regex")
    set_param(page, "format-spec", re.escape(EVIL))
    send(page, "Say something.")
    assert wait_state(page, "done", "error") == "done", last_answer(page).inner_text()
    content = last_answer(page).locator(".content")
    assert EVIL.replace(" **b**", "") in content.inner_text()  # shown as text
    assert content.locator("strong").inner_text() == "b"  # the markdown around it still renders
    assert page.locator("#messages img, #messages script, #messages [onerror]").count() == 0
    assert page.evaluate("() => window.p") is None

    # a saved chat crafted by hand renders through the same path after a reload
    crafted = {
        "id": "crafted",
        "title": "t",
        "created": 1,
        "updated": 9e12,
        "messages": [
            {"role": "user", "content": '<img src=x onerror="window.__pwned=3">'},
            {
                "role": "assistant",
                "state": "done",
                "content": "[link](javascript:window.__pwned=4) ![i](http://example.invalid/x.png)\n\n"
                '<svg onload="window.__pwned=5"></svg>\n\n<script>window.__pwned=6</script>',
            },
        ],
    }
    page.evaluate(
        "(c) => { localStorage.setItem('gw.chats', JSON.stringify([c])); localStorage.setItem('gw.chat', c.id); }",
        crafted,
    )
    page.reload()
    assert page.locator(".msg").count() == 2
    page.locator("#messages a").click()  # a javascript: link lost its href
    assert (
        page.locator(
            "#messages img, #messages svg, #messages script, #messages [onerror], #messages [onload]"
        ).count()
        == 0
    )
    assert page.locator("#messages a").get_attribute("href") is None
    assert page.evaluate("() => window.__pwned") is None

    page.click("#chat-list li[data-id=crafted] .chat-delete")  # deleting the open chat opens a new one
    assert page.locator("#chat-list li[data-id=crafted]").count() == 0 and page.locator(".msg").count() == 0
    assert "crafted" not in page.evaluate("() => localStorage.getItem('gw.chats')")
    assert page.evaluate(STORAGE_FULL) == {"saved": True, "entry": False, "content": "kept"}
    only_gateway(page, gw.base_url)


def test_view_code_is_the_request_and_inspect_entry(gw, page):  # noqa: F811 - fixtures
    record_posts(page)
    page.add_init_script(FAKE_INSPECTOR)
    _, key = new_tenant(gw, "code", limits={"rpm": 100})
    open_playground(page, gw.base_url, key, max_tokens=6, system="Be brief.")
    models = httpx.get(gw.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    ids = [m["id"] for m in models.json()["data"]]
    assert page.eval_on_selector_all("#model option", "(os) => os.map((o) => o.value)") == ids  # the picker
    for name, value in [("top_k", "40"), ("seed", "7"), ("min_p", "0.05"), ("stop", "\n\n\nEND"), ("n", "2")]:
        set_param(page, name, value)
    page.check("#p-logprobs")
    set_param(page, "top_logprobs", "2")
    page.fill("#prompt", "Name a colour.")
    page.click("#view-code")
    curl = page.inner_text("#code-curl")
    assert key not in curl and '"Authorization: Bearer $OPENAI_API_KEY"' in curl
    shown = json.loads(re.search(r"-d '(.*)'\s*$", curl, re.S).group(1))
    page.click("#tab-python")
    python = page.inner_text("#code-python")
    assert key not in python and "OPENAI_API_KEY" in python
    assert f'base_url="{gw.base_url}/v1"' in python and '"top_k": 40' in python and "extra_body=" in python
    page.click("#close-code")
    page.click("#send")
    assert wait_state(page, "done", "error") == "done", last_answer(page).inner_text()
    sent = posted_bodies(page)[-1]
    assert sent == shown
    assert (
        sent["stop"] == ["END"] and sent["n"] == 2 and sent["logprobs"] is True and sent["top_logprobs"] == 2
    )
    assert last_answer(page).locator("details.alt").count() == 1  # choice 1

    last_answer(page).locator("button.inspect").click()
    entry = page.evaluate("() => window.__entry")
    assert entry["request"] == sent
    resp = entry["response"]
    assert resp["object"] == "chat.completion" and len(resp["choices"]) == 2
    usage = resp["usage"]
    lps = [c["logprobs"]["content"] for c in resp["choices"]]
    # one entry per token of the content; a choice that ended at EOS also counts the EOS token it generated
    eos_ended = sum(c["finish_reason"] == "stop" for c in resp["choices"])
    assert sum(len(x) for x in lps) + eos_ended == usage["completion_tokens"], resp["choices"]
    assert all(len(t["top_logprobs"]) == 2 for x in lps for t in x)
    assert resp["timings"] and resp["id"]
    assert entry["request_id"] == entry["headers"]["x-request-id"]
    assert any(h.startswith("x-ratelimit-") for h in entry["headers"])

    set_param(page, "n", "")
    set_param(page, "top_p", "5")
    send(page, "Again.")
    assert wait_state(page, "error", "done") == "error"
    note = last_answer(page).locator(".notice").inner_text()
    assert "Bad request (400), parameter top_p" in note, note
    only_gateway(page, gw.base_url)


def test_inspect_button_opens_the_inspector(gw, page):  # noqa: F811 - fixtures
    _, key = new_tenant(gw, "insp-pg", limits={"rpm": 100})
    open_playground(page, gw.base_url, key, max_tokens=4)
    if not page.evaluate("() => !!window.Inspector"):
        pytest.skip("gateway/static/inspector.js is not there")
    page.check("#p-inspect")
    send(page, "Hi.")
    assert wait_state(page, "done", "error") == "done", last_answer(page).inner_text()
    last_answer(page).locator("button.inspect").click()
    page.wait_for_selector("#inspector[data-state=ready]")  # the record was found and drawn
    page.keyboard.press("Escape")
    only_gateway(page, gw.base_url)


def test_tool_call_and_json_answer_shown(gw, page):  # noqa: F811 - fixtures
    record_posts(page)
    _, key = new_tenant(gw, "tools-pg")
    open_playground(page, gw.base_url, key, max_tokens=40)
    set_param(page, "tools", json.dumps([WEATHER]))
    set_param(page, "tool_choice", "get_weather")
    send(page, "Weather in Oslo?")
    assert wait_state(page, "done", "error") == "done", last_answer(page).inner_text()
    assert posted_bodies(page)[-1]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    call = last_answer(page).locator(".tool-calls").inner_text()
    assert call.startswith("get_weather(") and json.loads(call[len("get_weather(") : -1])["city"] in (
        "Oslo",
        "Paris",
    )

    set_param(page, "tools", "")
    set_param(page, "tool_choice", "")
    set_param(page, "format", "json_schema")
    set_param(
        page,
        "format-spec",
        json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    )
    send(page, "Is it sunny?")
    assert wait_state(page, "done", "error") == "done", last_answer(page).inner_text()
    sent = posted_bodies(page)[-1]
    assert sent["response_format"]["type"] == "json_schema" and "tools" not in sent
    shown = last_answer(page).locator(".content pre code.language-json").inner_text()
    assert isinstance(json.loads(shown)["ok"], bool)

    set_param(page, "format-spec", "{not json")
    send(page, "Again?")
    assert "Parameters: response_format.json_schema.schema: not valid JSON" in page.inner_text("#status")
    assert len(page.posted) == 2 and page.input_value("#prompt") == "Again?"  # nothing sent, the text kept
    only_gateway(page, gw.base_url)
