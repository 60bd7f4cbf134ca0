"""The inspector (gateway/static/inspector.js) in a real browser, on the real gateway and backend.

The page sends two chat requests with the same long system prompt (the second with ``"inspect": true`` and
logprobs), so that the second one's prompt is partly served from the prefix cache, and opens the inspector
on each answer. On the second it checks what the issue asks: the cached span has exactly
``usage.prompt_tokens_details.cached_tokens`` tokens and they come first, the prompt shows ``prompt_tokens``
tokens with the special ones highlighted, the timeline's TTFT is the response's ``timings.ttft_duration``
as the page writes it (ms, one decimal), each output token has its probability and alternatives, the usage
and the remaining limits are shown. The first answer (no ``inspect``) has no record: the panel says so.
The record is the tenant's own (another tenant's key gets a 404); a stream with ``n = 2`` leaves one too,
a timeline per choice; no request leaves the gateway.

With ``LLM_GATEWAY_SCREENSHOTS=1`` the panel is saved to docs/img/inspector.png (1280x800) and
docs/img/inspector-phone.png (390x844).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
from test_browser_playground import browser, gw, open_playground, page  # noqa: F401 - fixtures
from test_filters_http import new_tenant

IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
SYSTEM = (
    "You are the assistant of a small harbour authority. You answer questions about tides, berths, "
    "fuel, weather warnings and opening hours. You are brief, exact and polite, and you never invent "
    "numbers: when you do not know, you say so and name the office to call."
)

# Two requests from the page itself, the same system prompt: the second may read it from the prefix cache.
SEND = """async ({key, model, system}) => {
  const out = [];
  for (const [q, inspect] of [["When is high tide?", false], ["Where can I buy fuel?", true]]) {
    const request = {model, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 3,
                     messages: [{role: "system", content: system}, {role: "user", content: q}]};
    if (inspect) request.inspect = true;
    const r = await fetch("/v1/chat/completions", {method: "POST", body: JSON.stringify(request),
      headers: {"Content-Type": "application/json", Authorization: "Bearer " + key}});
    const headers = {};
    r.headers.forEach((v, k) => { headers[k] = v; });
    const response = await r.json();
    out.push({request, response, headers, request_id: headers["x-request-id"] || response.id});
  }
  return out;
}"""


def _inspector_loaded(pg) -> None:
    if not pg.evaluate("() => !!window.Inspector"):  # a playground page that does not load it (yet)
        pg.add_style_tag(url="/static/inspector.css")
        pg.add_script_tag(url="/static/inspector.js")
    assert pg.evaluate("() => typeof window.Inspector.open") == "function"


def test_inspector_on_a_partly_cached_answer(gw, page):  # noqa: F811 - fixtures
    _, key = new_tenant(gw, "insp", limits={"rpm": 600, "tpm": 200_000})
    _, other = new_tenant(gw, "insp-other")
    page.set_viewport_size({"width": 1280, "height": 800})
    open_playground(page, gw.base_url, key, max_tokens=8)
    _inspector_loaded(page)
    plain, inspected = page.evaluate(SEND, {"key": key, "model": gw.model, "system": SYSTEM})
    resp = inspected["response"]
    usage, timings = resp["usage"], resp["timings"]
    prompt_tokens, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < prompt_tokens, usage  # partly cached

    # without "inspect" there is no record: the panel says so and still shows the usage
    page.evaluate("(e) => window.Inspector.open(e)", plain)
    page.wait_for_selector("#inspector[data-state=error]")
    assert "No inspection record" in page.locator("#inspector .insp-error").inner_text()
    assert page.locator('#inspector dd[data-key="prompt_tokens"]').inner_text() == str(
        plain["response"]["usage"]["prompt_tokens"]
    )

    page.evaluate("(e) => window.Inspector.open(e)", inspected)
    page.wait_for_selector("#inspector[data-state=ready]")
    d = page.locator("#inspector")
    toks = d.locator(".insp-prompt .tok")
    assert toks.count() == prompt_tokens
    assert d.locator(".insp-prompt .tok.cached").count() == cached
    flags = toks.evaluate_all("(ts) => ts.map((t) => t.classList.contains('cached'))")
    assert flags == [True] * cached + [False] * (prompt_tokens - cached)  # the cached span is the prefix
    specials = d.locator(".insp-prompt .tok.special")
    assert specials.count() >= 3 and specials.first.inner_text() == "<|im_start|>"
    assert re.fullmatch(r"#0  id \d+  special  cached  .*", toks.first.get_attribute("title"))
    assert "".join(toks.all_text_contents()).startswith("<|im_start|>system\n" + SYSTEM)

    # the timeline's TTFT is the response's, in the unit and precision the page shows
    shown = f"TTFT {timings['ttft_duration'] / 1e6:.1f} ms"
    assert d.locator(".insp-ttft").inner_text() == shown
    assert d.locator(".insp-timeline .ttft-label").text_content() == shown
    assert d.locator(".insp-timeline .bar.chunk").count() >= 1
    steps = d.locator(".insp-timeline .tick.decode").count()
    assert (
        steps == len(resp["choices"][0]["logprobs"]["content"]) - 1 or steps == usage["completion_tokens"] - 1
    )
    assert f"stop reason: {resp['choices'][0]['finish_reason']}" in d.locator(".insp-finish").inner_text()

    # output tokens: a probability colour each, the alternatives on hover
    lps = resp["choices"][0]["logprobs"]["content"]
    out = d.locator(".insp-out .otok")
    assert out.count() == len(lps) > 0
    title = out.first.get_attribute("title")
    assert "alternatives:" in title and re.search(r"\d+\.\d%", title)
    assert re.fullmatch(r"otok p[0-4]", out.first.get_attribute("class"))

    # usage and the tenant's remaining limits from the x-ratelimit-* headers
    assert d.locator('dd[data-key="cached_tokens"]').inner_text() == str(cached)
    h = inspected["headers"]
    for what in ("requests", "tokens"):
        left = d.locator(f'dd[data-key="limit-{what}"]').inner_text()
        assert left.startswith(f"{h['x-ratelimit-remaining-' + what]} of {h['x-ratelimit-limit-' + what]}")

    if os.environ.get("LLM_GATEWAY_SCREENSHOTS") == "1":
        IMG.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(IMG / "inspector.png"))
        page.set_viewport_size({"width": 390, "height": 844})
        page.screenshot(path=str(IMG / "inspector-phone.png"))
    page.keyboard.press("Escape")  # the dialog closes with Esc
    page.wait_for_function("() => !document.getElementById('inspector').open")

    # the record is the tenant's own, under the response id and the x-request-id alike
    url = gw.base_url + "/v1/inspect/"
    mine = httpx.get(url + resp["id"], headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert mine.status_code == 200 and mine.json()["prompt"]["cached_tokens"] == cached
    alias = httpx.get(url + inspected["request_id"], headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert alias.status_code == 200 and alias.json()["id"] == resp["id"]
    theirs = httpx.get(url + resp["id"], headers={"Authorization": f"Bearer {other}"}, timeout=30)
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "inspect_record_not_found"

    # a stream with n = 2 leaves a record too: one timeline per choice, each first token before the TTFT
    body = {
        "model": gw.model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "inspect": True,
    }
    with httpx.stream(
        "POST", gw.base_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        r.read()
    rec = httpx.get(url + rid, headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    assert [c["index"] for c in rec["choices"]] == [0, 1]
    for c in rec["choices"]:
        t = c["timeline"]
        assert (
            t["chunks"]
            and t["first_token"] <= rec["timings"]["ttft_duration"]
            and t["finish"] >= t["first_token"]
        )

    # no CDN, no other host: every request of the page went to the gateway
    assert page.requested and all(u.startswith(gw.base_url + "/") for u in page.requested), page.requested
