"""Observability against a real gateway subprocess with the real backend (tests/plugins/gateway_server.py).

Known traffic goes through /v1 and the Ollama API (official ``ollama`` client);
``/metrics`` is scraped before and after and the deltas are checked exactly
against what the responses (and, for the aborted request, its access-log
line) report; engine counters are cross-checked against the gateway's own
sums. A second gateway with a tiny KV pool (``--num-kv-blocks``) forces a
preemption. Requests generate 1-3 tokens to keep the file fast on 2 cores.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import ollama
import pytest

from gateway.observability.exposition import parse_exposition, sample_sum

pytestmark = pytest.mark.slow

P = "gateway:"
DISTINCT = "Quokka-marmalade-7731 says hello"  # must never reach the log


def scrape(gp) -> dict:
    r = httpx.get(gp.base_url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert "x-request-id" in r.headers
    return parse_exposition(r.text)


def d(before: dict, after: dict, name: str, **labels) -> float:
    return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)


def access_lines(gp) -> list[dict]:
    out = []
    for line in gp.log_path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{") and '"request_id"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def log_line(gp, rid: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        for e in access_lines(gp):
            if e["request_id"] == rid:
                return e
        if time.monotonic() > deadline:
            raise AssertionError(f"no access-log line for {rid}:\n{gp.log_tail()}")
        time.sleep(0.05)


def chat(gp, messages, *, rid: str | None = None, key: str | None = None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or gp.api_key}"}
    if rid:
        headers["x-request-id"] = rid
    body = {"model": gp.model, "messages": messages, "temperature": 0, **kw}
    return httpx.post(gp.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=300)


BLOCKED_WORD = "zanzibarquux"
FILTERS = {
    "output_window": 0,
    "hooks": [
        {"type": "blocklist", "name": "in", "keywords": [BLOCKED_WORD], "stages": ["prompt"]},
        {"type": "blocklist", "name": "out", "patterns": ["\\S"], "stages": ["output"]},
    ],
}


def _tenant_key(gp, rpm: int) -> str | None:
    """A fresh tenant with an rpm limit and a prompt blocklist, through the admin API; None when tenancy is not wired in."""
    h = gp.admin_headers()
    r = httpx.post(
        gp.base_url + "/admin/v1/tenants",
        json={
            "name": f"obs-{time.monotonic_ns()}",
            "limits": {"rpm": rpm, "window_s": 3600},
            "filters": FILTERS,
        },
        headers=h,
        timeout=30,
    )
    if r.status_code == 404:
        return None
    assert r.status_code == 201, r.text
    k = httpx.post(gp.base_url + f"/admin/v1/tenants/{r.json()['id']}/keys", json={}, headers=h, timeout=30)
    assert k.status_code == 201, k.text
    return k.json()["key"]


def test_metrics_logs_and_ollama_against_real_gateway(gateway):
    gp = gateway
    m1 = [{"role": "user", "content": DISTINCT}]
    m2 = [{"role": "user", "content": "Name a color."}]
    limited_key = _tenant_key(gp, rpm=1)
    gp.wait_idle(60)  # leftovers of earlier tests on the shared gateway must not count in our window
    before = scrape(gp)
    usages, reasons = [], []

    # --- /v1: one non-streaming request carrying a key, a request id and a distinctive prompt
    r1 = chat(gp, m1, rid="obs-e2e-1", max_tokens=2)
    assert r1.status_code == 200, r1.text
    assert r1.headers["x-request-id"] == "obs-e2e-1"
    usages.append(r1.json()["usage"])
    reasons.append(r1.json()["choices"][0]["finish_reason"])

    # --- an abort: a streaming client leaves after its first token (legacy completions with fresh
    #     random token ids, so that no prefix-cache hit goes uncounted: an aborted request has no usage)
    abort_ids = random.Random(time.time_ns()).sample(range(1000, 40000), 20)
    with httpx.stream(
        "POST",
        gp.base_url + "/v1/completions",
        headers={**gp.headers(), "x-request-id": "obs-e2e-abort"},
        timeout=300,
        json={
            "model": gp.model,
            "prompt": abort_ids,
            "temperature": 0,
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "obs-e2e-abort"
        for line in r.iter_lines():
            if line.startswith("data: ") and any(
                c.get("text") for c in json.loads(line[6:]).get("choices", [])
            ):
                break

    # --- Ollama API through the official client (the chat repeats r1's messages: a cached prefix)
    oc = ollama.Client(host=gp.base_url, headers={"Authorization": f"Bearer {gp.api_key}"})
    o1 = oc.chat(model=gp.model, messages=m1, options={"num_predict": 2, "temperature": 0})
    o2 = list(oc.chat(model=gp.model, messages=m2, options={"num_predict": 1, "temperature": 0}, stream=True))
    o3 = oc.generate(model=gp.model, prompt="Name a color.", options={"num_predict": 1, "temperature": 0})
    o4 = list(
        oc.generate(
            model=gp.model, prompt="Name a color.", options={"num_predict": 1, "temperature": 0}, stream=True
        )
    )
    assert o1.prompt_eval_count == usages[0]["prompt_tokens"]  # same messages: same count as /v1
    assert o1.message.content == r1.json()["choices"][0]["message"]["content"]  # greedy: same text
    assert o3.prompt_eval_count == o2[-1].prompt_eval_count  # generate = one user message
    assert "".join(p.response for p in o4) == o3.response
    assert "".join(p.message.content for p in o2) == o3.response
    for fin in (o1, o2[-1], o3, o4[-1]):
        assert fin.done and fin.eval_count >= 1 and fin.load_duration == 0
        assert fin.prompt_eval_duration > 0 and fin.eval_duration >= 0
        assert fin.prompt_eval_duration + fin.eval_duration <= fin.total_duration
        usages.append({"prompt_tokens": fin.prompt_eval_count, "completion_tokens": fin.eval_count})
        reasons.append(fin.done_reason)
    assert o1.eval_duration > 0
    assert not any(p.done for p in o2[:-1])

    # --- a 429 (tenant limited to 1 request per hour)
    n429 = n_blocked = n_cut = 0
    if limited_key is not None:
        ra = chat(gp, m2, key=limited_key, max_tokens=1)  # its output is cut by the tenant's output filter
        assert ra.status_code == 200, ra.text
        usages.append(ra.json()["usage"])
        reasons.append(ra.json()["choices"][0]["finish_reason"])
        n_cut = reasons[-1] == "content_filter"
        rb = chat(gp, m2, key=limited_key, max_tokens=1)
        assert rb.status_code == 429, rb.text
        n429 = 1
        rc = chat(
            gp, [{"role": "user", "content": f"Tell me about {BLOCKED_WORD}."}], key=limited_key, max_tokens=1
        )
        n_blocked = 1 if rc.status_code == 400 and rc.json()["error"]["code"] == "content_filter" else 0
        if rc.status_code == 429:  # content filters not wired in: the rpm limit answers instead
            n429 += 1
        else:
            assert n_blocked, rc.text

    # --- settle: the abort reaches the backend asynchronously
    deadline = time.monotonic() + 60
    while True:
        after = scrape(gp)
        if (
            d(before, after, P + "engine_aborts_total") >= 1
            and d(before, after, P + "request_aborts_total") >= 1
            and sample_sum(after, P + "num_requests_running") == 0
        ):
            break
        assert time.monotonic() < deadline, "abort not counted"
        time.sleep(0.2)

    ab = log_line(gp, "obs-e2e-abort")
    assert ab["finish_reason"] == "abort" and ab["status"] == 200 and ab["completion_tokens"] >= 1
    assert ab["prompt_tokens"] == len(abort_ids)
    n_done = len(usages)  # requests that finished normally
    prompt = sum(u["prompt_tokens"] for u in usages) + ab["prompt_tokens"]
    gen = sum(u["completion_tokens"] for u in usages) + ab["completion_tokens"]
    with_tokens = sum(1 for u in usages if u["completion_tokens"] > 0) + 1

    assert d(before, after, P + "prompt_tokens_total") == prompt
    assert d(before, after, P + "generation_tokens_total") == gen
    assert d(before, after, P + "time_to_first_token_seconds_count") == with_tokens
    assert d(before, after, P + "e2e_request_latency_seconds_count") == n_done + 1
    assert d(before, after, P + "request_prefill_time_seconds_count") == n_done
    for reason in set(reasons):
        assert d(before, after, P + "request_success_total", finished_reason=reason) == reasons.count(
            reason
        ), reason
    assert d(before, after, P + "request_success_total", finished_reason="abort") == 1
    assert d(before, after, P + "request_aborts_total") == 1
    assert d(before, after, P + "engine_aborts_total") == 1
    # backend counters vs the gateway's sums (no preemption on this gateway)
    assert d(before, after, P + "num_preemptions_total") == 0
    assert d(before, after, P + "prefix_cache_queries_total") == prompt
    assert (
        d(before, after, P + "prefix_cache_hits_total")
        == d(before, after, P + "prompt_tokens_cached_total")
        >= 16
    )
    assert log_line(gp, "obs-e2e-1")["cached_tokens"] is not None
    assert d(before, after, P + "engine_generation_tokens_total") >= gen
    v1_ok = 1 + (1 if limited_key else 0)
    assert d(before, after, P + "http_requests_total", path="/v1/chat/completions", status="200") == v1_ok
    assert d(before, after, P + "http_requests_total", path="/v1/completions", status="200") == 1
    assert d(before, after, P + "http_requests_total", path="/v1/chat/completions", status="429") == n429
    assert d(before, after, P + "rate_limited_requests_total", kind="requests") == n429
    assert d(before, after, P + "content_filter_blocks_total", stage="input") == n_blocked
    assert d(before, after, P + "content_filter_blocks_total", stage="output") == n_cut
    assert d(before, after, P + "http_requests_total", path="/api/chat", status="200") == 2
    assert d(before, after, P + "http_requests_total", path="/api/generate", status="200") == 2
    assert sample_sum(after, P + "kv_cache_blocks_total") > 0

    # --- the access log: fields present, no key, no prompt text
    e1 = log_line(gp, "obs-e2e-1")
    assert e1["status"] == 200 and e1["api"] == "openai" and e1["model"] == gp.model
    assert (
        e1["prompt_tokens"] == usages[0]["prompt_tokens"]
        and e1["completion_tokens"] == usages[0]["completion_tokens"]
    )
    assert e1["ttft_s"] > 0 and e1["prefill_s"] > 0 and e1["finish_reason"] == reasons[0]
    assert "prompt" not in e1 and "output" not in e1
    lines = [json.dumps(e) for e in access_lines(gp)]
    assert not any(gp.api_key in x for x in lines)
    if limited_key:
        assert limited_key not in gp.log_path.read_text(errors="replace")
    assert DISTINCT not in gp.log_path.read_text(errors="replace")
    assert any(e["api"] == "ollama" for e in access_lines(gp))


SPEC = "spec_decode_num_"
PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and "
    "wrote the names of passing ships in a worn leather book, while the wind rattled the windows and the "
    "gulls circled slowly above the dark and restless sea."
)


def _spec(samples: dict) -> tuple[float, float, float, dict[str, float]]:
    """Speculative decoding counters of a scrape, summed over backends: drafts, draft tokens, accepted
    tokens, accepted tokens by draft position."""
    pos: dict[str, float] = {}
    for (name, lv), v in samples.items():
        if name == P + SPEC + "accepted_tokens_per_pos_total":
            pos[dict(lv)["position"]] = pos.get(dict(lv)["position"], 0.0) + v
    drafts, drafted, accepted = (
        sample_sum(samples, P + SPEC + k + "_total") for k in ("drafts", "draft_tokens", "accepted_tokens")
    )
    return drafts, drafted, accepted, pos


def _check_spec_consistent(drafts: float, drafted: float, accepted: float, per_pos: list[float]) -> None:
    assert drafts >= 0 and 0 <= accepted <= drafted, (drafts, drafted, accepted)
    assert sum(per_pos) == accepted, (per_pos, accepted)
    assert all(v >= 0 for v in per_pos), per_pos
    if drafted > 0:
        assert drafts > 0 and 0 <= accepted / drafted <= 1


def test_speculative_decoding_in_timings_metrics_and_admin_stats(gateway):
    """A greedy answer that repeats its prompt (n-gram drafts find it there): the response's timings count
    drafts and acceptances, /metrics and /admin/v1/stats move by as much and stay consistent
    (accepted <= drafted, the positions sum to the accepted total); ``speculative: false`` on the same
    request gives the same text with nothing drafted and moves no counter; Ollama's final object counts
    the same."""
    gp = gateway
    messages = [{"role": "user", "content": "Repeat exactly: " + PARAGRAPH}]
    gp.wait_idle(60)  # leftovers of earlier tests on the shared gateway must not count in our window
    before, st0 = scrape(gp), gp.stats()

    r1 = chat(gp, messages, max_tokens=48)
    assert r1.status_code == 200, r1.text
    t1 = r1.json()["timings"]
    drafted, accepted = t1["draft_tokens"], t1["accepted_tokens"]
    assert 0 <= accepted <= drafted, t1
    gp.wait_idle(60)
    mid, st1 = scrape(gp), gp.stats()

    # /metrics: consistent in itself, and moved by what the response reports
    drafts_a, drafted_a, accepted_a, pos_a = _spec(mid)
    _check_spec_consistent(drafts_a, drafted_a, accepted_a, list(pos_a.values()))
    drafts_b, drafted_b, accepted_b, pos_b = _spec(before)
    dpos = [pos_a.get(k, 0.0) - pos_b.get(k, 0.0) for k in pos_a]
    _check_spec_consistent(drafts_a - drafts_b, drafted_a - drafted_b, accepted_a - accepted_b, dpos)
    assert (drafted_a - drafted_b, accepted_a - accepted_b) == (drafted, accepted), (t1, pos_a, pos_b)

    # /admin/v1/stats: the same counters (since each backend started), consistent, moved by as much
    for st in (st0, st1):
        _check_spec_consistent(
            st["spec_drafts"],
            st["spec_draft_tokens"],
            st["spec_accepted_tokens"],
            st["spec_accepted_per_pos"],
        )
    assert st1["spec_draft_tokens"] - st0["spec_draft_tokens"] == drafted, (st0, st1)
    assert st1["spec_accepted_tokens"] - st0["spec_accepted_tokens"] == accepted, (st0, st1)
    old = st0["spec_accepted_per_pos"] + [0] * (
        len(st1["spec_accepted_per_pos"]) - len(st0["spec_accepted_per_pos"])
    )
    assert sum(n - o for n, o in zip(st1["spec_accepted_per_pos"], old)) == accepted

    # opted out: the same tokens (lossless), nothing drafted, no counter moved
    r2 = chat(gp, messages, max_tokens=48, speculative=False)
    assert r2.status_code == 200, r2.text
    t2 = r2.json()["timings"]
    assert r2.json()["choices"][0]["message"]["content"] == r1.json()["choices"][0]["message"]["content"]
    assert r2.json()["usage"]["completion_tokens"] == r1.json()["usage"]["completion_tokens"]
    assert (t2["draft_tokens"], t2["accepted_tokens"]) == (0, 0), t2
    gp.wait_idle(60)
    after = scrape(gp)
    assert _spec(after)[:3] == (drafts_a, drafted_a, accepted_a)

    # the engine drafts for an answer that repeats its prompt (fails while speculative decoding is off)
    assert drafted > 0, f"no draft tokens for an answer that repeats its prompt: {t1}"

    # Ollama's final object carries the same counts (extension fields, which the official client drops)
    def ollama_chat(**options) -> dict:
        body = {"model": gp.model, "messages": messages, "stream": False, "options": options}
        r = httpx.post(gp.base_url + "/api/chat", json=body, headers=chat_headers, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    chat_headers = {"Authorization": f"Bearer {gp.api_key}"}
    o = ollama_chat(num_predict=48, temperature=0)
    assert o["message"]["content"] == r1.json()["choices"][0]["message"]["content"]
    assert (o["draft_tokens"], o["accepted_tokens"]) == (drafted, accepted), o
    o_off = ollama_chat(num_predict=48, temperature=0, speculative=False)
    assert (o_off["draft_tokens"], o_off["accepted_tokens"]) == (0, 0), o_off


def test_preemption_counted_with_tiny_kv_pool(make_gateway):
    # 7 blocks of 16 tokens; three 32-token prompts (2 blocks each, no shared prefix) whose first decode
    # step needs a third block each: 9 > 7, so the newest running request is preempted and recomputed.
    # This gateway also runs with content logging and the tenant label switched on.
    gp = make_gateway(
        "--num-kv-blocks", "7", env={"GATEWAY_LOG_CONTENT": "1", "GATEWAY_METRICS_TENANT_LABEL": "1"}
    )
    before = scrape(gp)
    rng = random.Random(time.time_ns())
    rids = [f"obs-pre-{i}" for i in range(3)]
    results: dict[str, httpx.Response] = {}

    def one(i: int) -> None:
        body = {
            "model": gp.model,
            "prompt": rng.sample(range(1000, 40000), 32),
            "temperature": 0,
            "max_tokens": 4,
            "ignore_eos": True,
        }
        results[rids[i]] = httpx.post(
            gp.base_url + "/v1/completions",
            json=body,
            headers={**gp.headers(), "x-request-id": rids[i]},
            timeout=300,
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(results[r].status_code == 200 for r in rids), {r: results[r].text for r in results}
    after = scrape(gp)
    pre = sum(log_line(gp, r)["preemptions"] for r in rids)
    assert pre >= 1, [log_line(gp, r) for r in rids]
    assert d(before, after, P + "num_preemptions_total") == pre
    assert d(before, after, P + "time_to_first_token_seconds_count") == 3
    assert d(before, after, P + "request_success_total", finished_reason="length") == 3
    assert d(before, after, P + "generation_tokens_total") == 12
    assert d(before, after, P + "prompt_tokens_total") == 96
    assert sample_sum(after, P + "kv_cache_blocks_total") == 7
    tid = gp.extra.get("tenant_id")
    if tid:
        assert d(before, after, P + "prompt_tokens_total", tenant=tid) == 96
    for r in rids:  # --log-content: the prompt (token ids here) and the output text are in the line
        e = log_line(gp, r)
        assert e["prompt"].startswith("[") and len(json.loads(e["prompt"])) == 32
        assert e["output"] == results[r].json()["choices"][0]["text"]
