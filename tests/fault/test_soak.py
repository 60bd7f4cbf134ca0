"""A soak of ``SOAK_REQUESTS`` requests with random client disconnects leaves nothing behind.

The fault suite's shared gateway (``borrow_gateway``), a tenant of its own whose limits are high enough that admission refuses nothing
(``max_concurrent`` twice the clients; ``tpm`` over a day-long window, so that the token bucket hardly
refills and what it holds can be compared with the ledger). ``CLIENTS`` clients share a fixed list of
requests drawn from ``random.Random(SEED)``: chat (streamed or not), completions (streamed or not) and Ollama
chat (NDJSON or one JSON object), each with 1-8 tokens to generate, each sent with its own ``x-request-id``.
About 40% are left by their client: before the answer starts (the request cancelled within 50 ms of being
sent) or in the middle (after 1-2 stream lines, or 50-400 ms into a non-streamed answer).

Afterwards: the engine is idle (running 0, waiting 0, the KV blocks used measured before the soak); no
request is in flight and none was answered with a 5xx (a client that left is 499, not a server error); the
ledger has one row per admitted request, with the true status (200 for the answers read to the end, their
completion tokens as the client saw them; 499 or 200 for the others) and the tokens billed are the tokens
the engine generated; no rate-limit reservation is left: the token bucket holds exactly what the ledger
billed, and a concurrency limit of 1 admits the next request.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest
import trio
from plugins.records import ledger_rows

SEED = 20261201
SOAK_REQUESTS = 1000
CLIENTS = 32
DISCONNECT_SHARE = 0.4  # half of them before the answer starts, half in the middle
REQUEST_TIMEOUT_S = 60.0  # one request (a hang is a failure)
TPM = 1_000_000  # tokens per window
WINDOW_S = 86400.0  # the tpm window: the bucket refills TPM / WINDOW_S tokens per second
PROMPTS = (
    "Name a colour.",
    "Count to three.",
    "Say hello in French.",
    "What is two plus two?",
    "Write one word about the sea.",
    "Give me a fruit.",
)

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Spec:
    """One soak request: ``api`` chat | completion | ollama, ``stream``, ``max_tokens`` (1-8), ``leave``
    None (read to the end) | "early" (cancelled ``delay`` s after sending) | "mid" (after ``lines`` stream
    lines, or ``delay`` s into a non-streamed answer)."""

    rid: str
    api: str
    stream: bool
    max_tokens: int
    prompt: str
    leave: str | None
    delay: float = 0.0
    lines: int = 0


def soak_specs(n: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        api = rng.choices(("chat", "completion", "ollama"), weights=(55, 20, 25))[0]
        stream = rng.random() < 0.6
        u = rng.random()
        leave = None if u >= DISCONNECT_SHARE else ("early" if u < DISCONNECT_SHARE / 2 else "mid")
        delay = rng.uniform(0.0, 0.05) if leave == "early" else rng.uniform(0.05, 0.4)
        out.append(
            Spec(
                rid=f"soak-{seed}-{i:04d}",
                api=api,
                stream=stream,
                max_tokens=rng.randint(1, 8),
                prompt=rng.choice(PROMPTS),
                leave=leave,
                delay=delay,
                lines=rng.randint(1, 2),
            )
        )
    return out


def request_of(spec: Spec, model: str) -> tuple[str, dict]:
    """(path, JSON body) of ``spec``."""
    if spec.api == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": spec.prompt}]}
        body |= {"max_tokens": spec.max_tokens, "stream": spec.stream}
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", body
    if spec.api == "completion":
        body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": spec.stream}
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        return "/v1/completions", body
    body = {"model": model, "messages": [{"role": "user", "content": spec.prompt}], "stream": spec.stream}
    return "/api/chat", body | {"options": {"num_predict": spec.max_tokens}}


@dataclass
class Outcome:
    spec: Spec
    status: int | None = None  # None: the client left before the status line
    completion_tokens: int | None = None  # as the client read them (answers read to the end)
    answer_id: str | None = None  # the /v1 answer's id (chatcmpl-..., cmpl-...): the ledger's request_id
    left: bool = False


def read_answer(out: Outcome, lines: list[bytes], body: bytes) -> None:
    """Fill ``out`` from an answer read to the end: its completion tokens (``usage.completion_tokens`` on /v1,
    ``eval_count`` on Ollama) and, on /v1, its id."""
    spec = out.spec
    objs: list[dict] = []
    if spec.stream:
        for raw in lines:
            text = raw.decode().strip()
            if spec.api != "ollama":
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                text = text[6:]
            if text:
                objs.append(json.loads(text))
    else:
        objs.append(json.loads(body))
    for obj in reversed(objs):
        if spec.api == "ollama" and "eval_count" in obj:
            out.completion_tokens = int(obj["eval_count"])
            break
        if spec.api != "ollama" and obj.get("usage"):
            out.completion_tokens = int(obj["usage"]["completion_tokens"])
            break
    if spec.api != "ollama" and objs:
        out.answer_id = objs[0].get("id")


async def run_one(client: httpx.AsyncClient, spec: Spec, model: str, key: str) -> Outcome:
    path, body = request_of(spec, model)
    headers = {"Authorization": f"Bearer {key}", "x-request-id": spec.rid}
    out = Outcome(spec)
    with trio.fail_after(REQUEST_TIMEOUT_S):
        if spec.leave == "early" or (spec.leave == "mid" and not spec.stream):
            with trio.move_on_after(spec.delay):
                async with client.stream("POST", path, json=body, headers=headers) as r:
                    out.status = r.status_code
                    await r.aread()
                    if r.status_code == 200:
                        read_answer(out, [], r.content)
                return out  # answered before the client meant to leave
            out.left = True
            return out
        async with client.stream("POST", path, json=body, headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200 or not spec.stream:
                await r.aread()
                if r.status_code == 200:
                    read_answer(out, [], r.content)
                return out
            lines: list[bytes] = []
            async for line in r.aiter_lines():
                if line.strip():
                    lines.append(line.encode())
                if spec.leave == "mid" and len(lines) >= spec.lines:
                    out.left = True
                    return out  # closing the stream here drops the connection
            read_answer(out, lines, b"")
            return out


@dataclass
class Soak:
    outcomes: list[Outcome]
    baseline: dict
    after: dict
    metrics: str
    ledger: list[dict]
    usage_total: int
    remaining_tokens: int | None
    refill: float
    next_status: int
    seconds: float
    log: str = ""
    extra: dict = field(default_factory=dict)


def remaining_tokens(gp) -> int | None:
    """The tenant's ``x-ratelimit-remaining-tokens`` now (on an answer that reserves nothing), or None."""
    r = httpx.get(gp.base_url + "/v1/models", headers=gp.headers(), timeout=30)
    value = r.headers.get("x-ratelimit-remaining-tokens")
    return int(value) if value is not None else None


async def soak(gp, specs: list[Spec]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    send, recv = trio.open_memory_channel[Spec](len(specs))
    for s in specs:
        send.send_nowait(s)
    send.close()
    limits = httpx.Limits(max_connections=CLIENTS * 2, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=gp.base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            async for spec in recv:
                outcomes.append(await run_one(client, spec, gp.model, gp.api_key))

        async with trio.open_nursery() as nursery:
            for _ in range(CLIENTS):
                nursery.start_soon(worker)
    return outcomes


def metric_samples(text: str, name: str) -> list[tuple[str, float]]:
    """(label text, value) of every sample of metric ``name`` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            out.append((labels[len(name) :], float(value)))
    return out


@pytest.fixture(scope="module")
def soaked(borrow_gateway):
    gp = borrow_gateway()  # the shared fault gateway (one torch thread: the clients need the other core)
    try:
        tid = gp.extra["tenant_id"]
        A = gp.admin_headers()
        limits = {"rpm": None, "tpm": TPM, "max_concurrent": 2 * CLIENTS, "daily_tokens": None}
        r = httpx.put(
            gp.base_url + f"/admin/v1/tenants/{tid}/limits",
            json=limits | {"window_s": WINDOW_S},
            headers=A,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        # warm-up (kernels, prefix cache of the chat template), then the baseline
        for api in ("chat", "completion", "ollama"):
            spec = Spec("soak-warmup-" + api, api, False, 2, PROMPTS[0], None)
            path, body = request_of(spec, gp.model)
            assert (
                httpx.post(gp.base_url + path, json=body, headers=gp.headers(), timeout=60).status_code == 200
            )
        baseline = gp.wait_idle(timeout=30)
        warm_ids = {r["id"] for r in ledger_rows(gp, tenant_id=tid, at_least=3, timeout=20, flush=True)}
        specs = soak_specs(SOAK_REQUESTS, SEED)
        t_start = time.monotonic()
        before_remaining = remaining_tokens(gp)
        outcomes = trio.run(soak, gp, specs)
        seconds = time.monotonic() - t_start
        after = gp.wait_idle(timeout=30, baseline_kv=baseline["kv_blocks_used"])
        metrics = httpx.get(gp.base_url + "/metrics", timeout=30).text
        admitted_at_least = sum(1 for o in outcomes if o.status == 200 and not o.left)
        rows = ledger_rows(
            gp, tenant_id=tid, at_least=len(warm_ids) + admitted_at_least, timeout=20, flush=True
        )
        soak_rows = [r for r in rows if r["id"] not in warm_ids]
        usage_total = sum(r["total_tokens"] for r in soak_rows)
        t_measure = time.monotonic()
        remaining = remaining_tokens(gp)
        refill = (t_measure - t_start + 1.0) * TPM / WINDOW_S  # at most (the bucket drains continuously)
        extra = {"before_remaining": before_remaining}
        # a leaked concurrency slot would refuse this request once only one is allowed
        r = httpx.put(
            gp.base_url + f"/admin/v1/tenants/{tid}/limits",
            json=limits | {"max_concurrent": 1, "window_s": WINDOW_S},
            headers=A,
            timeout=30,
        )
        path, body = request_of(Spec("soak-next", "chat", False, 1, PROMPTS[0], None), gp.model)
        nxt = httpx.post(gp.base_url + path, json=body, headers=gp.headers(), timeout=60)
        extra["limit_change"] = r.status_code
        return Soak(
            outcomes=outcomes,
            baseline=baseline,
            after=after,
            metrics=metrics,
            ledger=soak_rows,
            usage_total=usage_total,
            remaining_tokens=remaining,
            refill=refill,
            next_status=nxt.status_code,
            seconds=seconds,
            log=gp.log_tail(200),
            extra=extra,
        )
    finally:
        gp.stop()


def test_soak_every_request_ends_and_refusals_are_429(soaked):
    outcomes = soaked.outcomes
    assert len(outcomes) == SOAK_REQUESTS
    left = sum(o.left for o in outcomes)
    assert 0.3 * SOAK_REQUESTS <= left <= 0.5 * SOAK_REQUESTS, left  # the disconnects happened
    bad = [(o.spec.rid, o.status) for o in outcomes if o.status not in (None, 200, 429)]
    assert not bad, bad[:20]
    read = [o for o in outcomes if o.status == 200 and not o.left]
    assert len(read) >= 0.5 * SOAK_REQUESTS, len(read)
    missing = [o.spec.rid for o in read if o.completion_tokens is None]
    assert not missing, f"answers without usage: {missing[:20]}"


def test_soak_leaves_the_engine_idle(soaked):
    st, base = soaked.after, soaked.baseline
    assert (st["running"], st["waiting"]) == (0, 0), st
    assert st["kv_blocks_used"] == base["kv_blocks_used"], (st["kv_blocks_used"], base["kv_blocks_used"])
    in_flight = metric_samples(soaked.metrics, "gateway:http_requests_in_flight")
    assert in_flight and in_flight[0][1] <= 1, in_flight  # the /metrics request itself at most


def test_soak_disconnects_are_not_server_errors(soaked):
    samples = metric_samples(soaked.metrics, "gateway:http_requests_total")
    server_errors = [(labels, v) for labels, v in samples if 'status="5' in labels and v]
    assert not server_errors, server_errors
    assert any('status="499"' in labels and v for labels, v in samples), samples  # disconnects are 499
    ledger_5xx = [
        (r["request_id"], r["status"], r["finish_reason"]) for r in soaked.ledger if (r["status"] or 0) >= 500
    ]
    assert not ledger_5xx, ledger_5xx[:20]


def test_soak_ledger_keeps_the_true_status(soaked):
    rows: dict[str, list[dict]] = {}
    for r in soaked.ledger:
        rows.setdefault(r["request_id"], []).append(r)
    assert all(len(v) == 1 for v in rows.values()), [k for k, v in rows.items() if len(v) > 1][:10]
    read = [o for o in soaked.outcomes if o.status == 200 and not o.left]
    wrong = []
    for o in read:  # an answer read to the end is billed as it was answered (the /v1 ones by their id)
        if o.spec.api == "ollama":
            continue
        row = rows.get(o.answer_id or "", [None])[0]
        if row is None or row["status"] != 200 or row["completion_tokens"] != o.completion_tokens:
            got = row and (row["status"], row["finish_reason"], row["completion_tokens"])
            wrong.append((o.spec.rid, o.answer_id, o.completion_tokens, got))
    assert not wrong, f"{len(wrong)} of {len(read)} answers read to the end: {wrong[:20]}"
    statuses = [r["status"] for r in soaked.ledger]
    assert statuses.count(200) >= len(read), (statuses.count(200), len(read))  # the Ollama ones too
    assert set(statuses) <= {200, 499}, sorted(set(statuses), key=str)
    assert 499 in statuses, "no disconnect billed as 499"


def test_soak_bills_every_generated_token(soaked):
    generated = soaked.after["generation_tokens"] - soaked.baseline["generation_tokens"]
    billed = sum(r["completion_tokens"] for r in soaked.ledger)
    assert billed == generated, (billed, generated)


def test_soak_leaves_no_reservation(soaked):
    # debt = what the ledger billed, less the refill since the soak began (the bucket never ran empty)
    assert soaked.remaining_tokens is not None and soaked.extra["before_remaining"] is not None
    expected = soaked.extra["before_remaining"] - soaked.usage_total
    got = soaked.remaining_tokens
    assert expected - 1 <= got <= expected + soaked.refill + 1, (got, expected, soaked.refill)
    assert soaked.extra["limit_change"] == 200, soaked.extra["limit_change"]
    assert soaked.next_status == 200, soaked.next_status  # no concurrency slot left behind
