"""Serving benchmark: streaming load against any OpenAI-compatible ``/v1/chat/completions`` (httpx on Trio).

Usage::

    python bench/serve.py --base-url http://127.0.0.1:8000 --api-key $KEY \\
        --concurrency 32 --num-requests 128 --prompt-tokens 128 --output-tokens 64 --json out.json
    python bench/serve.py ... --rate 12 --mix      # open loop: Poisson arrivals, mixed prompts, goodput
    python bench/serve.py ... --peer http://127.0.0.1:8080   # every workload against both, ratios
    python bench/serve.py ... --speculative [--admin-key $ADMIN] [--peer URL]   # speculation off vs on

Each request streams (``stream_options.include_usage``) a synthetic prompt of about ``--prompt-tokens``
tokens (distinct per request, so the prefix cache does not serve it) and asks for exactly
``--output-tokens`` tokens (``ignore_eos``, an extension most OpenAI-compatible servers accept, llama-server
included; turn it off with ``--no-ignore-eos``).

``--mix`` (open loop): prompt lengths drawn from ``--mix-lengths`` (default 32, 128, 512 tokens), and a
``--shared-fraction`` of the requests (default a third) carry one shared ``--shared-doc-tokens`` document
(default ~600 tokens, the same text in every such request, as its system message) before a distinct short
question, so a server with a prefix cache computes the document once.

``--peer URL``: the suite (closed loop at 1 and ``--peer-concurrency`` streams, short-prompt TTFT,
cold ``--cold-tokens`` TTFT, the mixed open loop at ``--rate``, default 12/s) runs against ``--base-url``
and then against the peer, workload by workload, back to back, and each figure is printed with its ratio
ours / peer. ``--workloads`` picks some of ``closed1,closedN,short,cold,open,turn2`` (``turn2``: the
second turn of a two-turn chat against a one-turn prompt of the new turn's length, ``run_two_turn``;
not in the default list).

``--speculative``: the prompt sets of ``bench/spec_prompts.py`` (``grounded``: quote, summarize, edit or extract
from a given text, the answer reusing spans of the prompt; ``open``: open-ended chat), one request at a time,
each prompt with the body extra ``"speculative": false`` then without it (the default, on), and with
``--peer`` then against the peer (no extra field), greedy (``--spec-sampled``: also temperature 0.8 with a
fixed ``seed``), ``--output-tokens`` (default 128 in this mode), stopping at EOS unless ``--ignore-eos``.
Each prompt is first sent once with ``max_tokens`` 1 to every side, so that each finds it in its prefix cache
(off and on share the tenant's cache salt; without this the second would be served from the first's cache).
Per set: decode tok/s (completion tokens after the first / time from the first content to the end, summed
over the prompts), end-to-end tok/s, the ratios on / off (and ours / peer), the acceptance from each
response's ``timings`` (``accepted_tokens`` / ``draft_tokens``) and, with ``--admin-key``, per draft position
from ``/admin/v1/stats`` (differences before / after a set: other traffic on the gateway counts too); the
texts off and on must be identical (``MISMATCH`` otherwise, exit status 1).

Printed and written to JSON (times in milliseconds):
* request throughput (req/s) and output token throughput (tokens/s) over the whole run;
* TTFT (request sent -> first content byte), TPOT ((e2e - TTFT) / (completion_tokens - 1)),
  ITL (gaps between content chunks), e2e latency: mean, p50, p90, p99;
* goodput: the share of the requests sent whose TTFT <= ``--slo-ttft-ms`` (1000) and whose own ITL p99 <=
  ``--slo-itl-ms`` (200); a failed request counts against it;
* gateway overhead = client TTFT - the backend's own TTFT (``timings.backend_ttft_duration``, ns, this
  gateway's extension field; absent elsewhere): p50, p90, p99. It also holds time spent inside the backend
  process that its TTFT does not count (a Submit waiting in the backend's inbox for the running step, the
  backend's writer thread). ``gateway_internal`` (``timings.gateway_overhead_duration``) is the gateway's own
  share measured inside it: HTTP arrival -> Submit queued, plus first output frame decoded -> first content
  event handed to the HTTP server;
* errors (HTTP status or error events), with the first few messages.

Percentiles: nearest-rank on the sorted samples.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import trio

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact"
).split()


@dataclass
class Result:
    ok: bool = False
    status: int = 0
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None  # seconds
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    backend_ttft: float | None = None  # seconds
    gateway_internal: float | None = None  # seconds: the gateway's own share, measured inside it
    gateway_prep: float | None = None  # seconds: HTTP arrival -> Submit queued (part of gateway_internal)
    text: str = ""  # the content received, joined
    draft_tokens: int | None = None  # speculative decoding (``timings``, this gateway's extension)
    accepted_tokens: int | None = None


def make_prompt(n_tokens: int, i: int, rng: random.Random) -> str:
    """About ``n_tokens`` tokens for byte-level BPE tokenizers (one common word + space is one token)."""
    head = f"Request {i}: "
    return head + " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens - 12)))


def shared_document(n_tokens: int, seed: int) -> str:
    """The same ~``n_tokens``-token text for every request of a run (the shared prefix of ``--mix``)."""
    rng = random.Random(f"doc:{seed}")
    return "Document: " + " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens - 4)))


def messages_for(args, i: int, rng: random.Random) -> list[dict]:
    """Request ``i``'s messages: a distinct prompt, or with ``args.mix`` one of the mixed shapes."""
    if not getattr(args, "mix", False):
        return [{"role": "user", "content": make_prompt(args.prompt_tokens, i, rng)}]
    if rng.random() < args.shared_fraction:
        return [
            {"role": "system", "content": shared_document(args.shared_doc_tokens, args.seed)},
            {"role": "user", "content": make_prompt(24, i, rng)},
        ]
    lengths = [int(x) for x in str(args.mix_lengths).split(",")]
    return [{"role": "user", "content": make_prompt(rng.choice(lengths), i, rng)}]


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


def summary(xs: list[float]) -> dict:
    ms = [x * 1000 for x in xs]
    return {
        "n": len(ms),
        "mean": (sum(ms) / len(ms)) if ms else None,
        "p50": pct(ms, 50),
        "p90": pct(ms, 90),
        "p99": pct(ms, 99),
    }


def goodput(results: list[Result], ttft_s: float, itl_s: float) -> float | None:
    """Share of ``results`` (failed ones included) with TTFT <= ``ttft_s`` and own ITL p99 <= ``itl_s``."""
    if not results:
        return None
    good = sum(
        1
        for r in results
        if r.ok and r.ttft is not None and r.ttft <= ttft_s and (pct(r.itl, 99) or 0.0) <= itl_s
    )
    return good / len(results)


def slo_misses(results: list[Result], ttft_s: float, itl_s: float) -> dict[str, int]:
    """Why requests miss the goodput bounds: ``failed`` (error), ``ttft`` (TTFT over ``ttft_s``), ``itl``
    (own ITL p99 over ``itl_s``; a request over both counts in both)."""
    ok = [r for r in results if r.ok and r.ttft is not None]
    return {
        "failed": len(results) - len(ok),
        "ttft": sum(1 for r in ok if r.ttft > ttft_s),
        "itl": sum(1 for r in ok if (pct(r.itl, 99) or 0.0) > itl_s),
    }


async def one(
    client: httpx.AsyncClient,
    args,
    i: int,
    rng: random.Random,
    messages: list[dict] | None = None,
    extra: dict | None = None,
) -> Result:
    """One streaming request (``messages``: these instead of ``messages_for``; ``extra``: more body fields)."""
    res = Result(start=time.perf_counter())
    body = {
        "model": args.model,
        "messages": messages if messages is not None else messages_for(args, i, rng),
        "max_tokens": args.output_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        # past EOS the model writes special tokens (<|im_end|>, <|im_start|>); shown as text, each is a chunk
        # as every other token is, so a skipped one does not read as a doubled inter-token gap
        body["ignore_eos"] = True
        body["skip_special_tokens"] = False
    body.update(extra or {})
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    last = None
    try:
        async with client.stream(
            "POST", args.base_url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers
        ) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:300]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = json.dumps(ev["error"])[:300]
                    return res
                now = time.perf_counter()
                for c in ev.get("choices") or []:
                    content = (c.get("delta") or {}).get("content")
                    if content is None and "text" in c:  # a completions chunk
                        content = c["text"]
                    if content is None or (res.ttft is None and not content):
                        continue
                    # a token chunk: after the first text, every chunk counts, an empty one too (a token
                    # whose text is empty: a skipped special token), as vLLM's benchmark_serving counts them
                    if c.get("finish_reason") is not None and not content:
                        continue
                    if res.ttft is None:
                        res.ttft = now - res.start
                    elif last is not None:
                        res.itl.append(now - last)
                    last = now
                    res.text += content
                if ev.get("usage"):
                    res.completion_tokens = ev["usage"]["completion_tokens"]
                    res.prompt_tokens = ev["usage"]["prompt_tokens"]
                t = ev.get("timings") or {}
                if "backend_ttft_duration" in t:
                    res.backend_ttft = t["backend_ttft_duration"] / 1e9
                if "gateway_overhead_duration" in t:
                    res.gateway_internal = t["gateway_overhead_duration"] / 1e9
                if "gateway_prep_duration" in t:
                    res.gateway_prep = t["gateway_prep_duration"] / 1e9
                if "draft_tokens" in t:
                    res.draft_tokens = t["draft_tokens"]
                    res.accepted_tokens = t.get("accepted_tokens", 0)
        res.e2e = time.perf_counter() - res.start
        res.ok = res.ttft is not None
        if not res.ok:
            res.error = "no content received"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_two_turn(args) -> dict:
    """``--workloads turn2``: per request, a first turn (a distinct ``--turn-tokens`` prompt, answered up to
    64 tokens, stopping at EOS), then the second turn (that history, the answer and a new ~64-token user
    message; 2 tokens) and a one-turn prompt of the new message's length alone (2 tokens), one at a time.
    Returns the TTFTs of both and ``turn_ratio`` = p50 second-turn TTFT / p50 one-turn TTFT (a server whose
    prefix cache keeps the previous answer computes only the new turn: about 1)."""
    results: dict[str, list[Result]] = {"first": [], "second": [], "one": []}
    plain = {"ignore_eos": False, "skip_special_tokens": True}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        for i in range(args.num_requests):
            rng = random.Random(f"turn2:{args.seed}:{i}")
            history = [{"role": "user", "content": make_prompt(args.turn_tokens, i, rng)}]
            a1 = argparse.Namespace(**{**vars(args), "output_tokens": 64, "ignore_eos": False})
            first = await one(client, a1, i, rng, history, plain)
            results["first"].append(first)
            if not first.ok:
                continue
            a2 = argparse.Namespace(**{**vars(args), "output_tokens": 2, "ignore_eos": False})
            turn = {"role": "user", "content": make_prompt(64, 10_000 + i, rng)}
            second = [*history, {"role": "assistant", "content": first.text}, turn]
            results["second"].append(await one(client, a2, i, rng, second, plain))
            alone = {"role": "user", "content": make_prompt(64, 20_000 + i, rng)}
            results["one"].append(await one(client, a2, i, rng, [alone], plain))
    every = [r for rs in results.values() for r in rs]
    second_ttft = summary([r.ttft for r in results["second"] if r.ok])
    one_ttft = summary([r.ttft for r in results["one"] if r.ok])
    ratio = None
    if second_ttft["p50"] is not None and one_ttft["p50"]:
        ratio = second_ttft["p50"] / one_ttft["p50"]
    return {
        "wall_s": time.perf_counter() - t0,
        "requests": len(every),
        "ok": sum(r.ok for r in every),
        "errors": sum(not r.ok for r in every),
        "second_turn_ttft_ms": second_ttft,
        "one_turn_ttft_ms": one_ttft,
        "turn_ratio": ratio,
    }


async def run(args) -> dict:
    if getattr(args, "two_turn", False):
        return await run_two_turn(args)
    limits = httpx.Limits(
        max_connections=max(args.concurrency, 256), max_keepalive_connections=max(args.concurrency, 256)
    )
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        if not args.model:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            for _ in range(120):  # a server still loading its model answers 503 for a while
                r = await client.get(args.base_url.rstrip("/") + "/v1/models", headers=headers)
                if r.status_code == 200:
                    break
                await trio.sleep(0.5)
            data = r.json()
            args.model = (data.get("data") or data.get("models"))[0].get("id") or "default"
        rng = random.Random(args.seed)
        for w in range(args.warmup):
            await one(client, args, -1 - w, rng)
        t0 = time.perf_counter()
        if args.rate:
            async with trio.open_nursery() as nursery:

                async def fire(i):
                    results.append(await one(client, args, i, random.Random(args.seed + i)))

                for i in range(args.num_requests):
                    nursery.start_soon(fire, i)
                    await trio.sleep(rng.expovariate(args.rate))
        else:
            counter = iter(range(args.num_requests))

            async def worker():
                for i in counter:
                    results.append(await one(client, args, i, random.Random(args.seed + i)))

            async with trio.open_nursery() as nursery:
                for _ in range(args.concurrency):
                    nursery.start_soon(worker)
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    errs = [r for r in results if not r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    tpot = [
        (r.e2e - r.ttft) / (r.completion_tokens - 1)
        for r in ok
        if r.completion_tokens > 1 and r.e2e and r.ttft is not None
    ]
    overhead = [r.ttft - r.backend_ttft for r in ok if r.backend_ttft is not None and r.ttft is not None]
    slo_ttft, slo_itl = getattr(args, "slo_ttft_ms", 1000.0), getattr(args, "slo_itl_ms", 200.0)
    return {
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "wall_s": wall,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(errs),
        "error_samples": [(r.status, r.error) for r in errs[:5]],
        "request_throughput_rps": len(ok) / wall if wall else None,
        "output_tokens_per_s": out_tokens / wall if wall else None,
        "mean_prompt_tokens": (sum(r.prompt_tokens for r in ok) / len(ok)) if ok else None,
        "mean_completion_tokens": (out_tokens / len(ok)) if ok else None,
        "goodput": goodput(results, slo_ttft / 1000, slo_itl / 1000),
        "slo_misses": slo_misses(results, slo_ttft / 1000, slo_itl / 1000),
        "request_itl_p99_ms": summary([pct(r.itl, 99) for r in ok if r.itl]),
        "ttft_ms": summary([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": summary(tpot),
        "itl_ms": summary([x for r in ok for x in r.itl]),
        "e2e_ms": summary([r.e2e for r in ok if r.e2e is not None]),
        "backend_ttft_ms": summary([r.backend_ttft for r in ok if r.backend_ttft is not None]),
        "gateway_overhead_ms": summary(overhead),
        "gateway_internal_ms": summary([r.gateway_internal for r in ok if r.gateway_internal is not None]),
        "gateway_prep_ms": summary([r.gateway_prep for r in ok if r.gateway_prep is not None]),
    }


def _fmt(d: dict) -> str:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    return f"mean {f(d['mean'])}  p50 {f(d['p50'])}  p90 {f(d['p90'])}  p99 {f(d['p99'])}  (n={d['n']})"


# ---------------------------------------------------------------------- the suite against a peer


def suite(args) -> dict[str, tuple[dict, list[tuple[str, Callable[[dict], float | None]]]]]:
    """The workloads of ``--peer``: name -> (overrides of the namespace, [(figure label, reader of a result)])."""
    n_big = args.peer_concurrency
    return {
        "closed1": (
            {"concurrency": 1, "rate": 0.0, "num_requests": 4, "mix": False},
            [("1-stream out tok/s", lambda r: r["output_tokens_per_s"])],
        ),
        "closedN": (
            {"concurrency": n_big, "rate": 0.0, "num_requests": 2 * n_big, "mix": False},
            [
                (f"{n_big}-stream out tok/s", lambda r: r["output_tokens_per_s"]),
                (f"{n_big}-stream TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]),
            ],
        ),
        "short": (
            {
                "concurrency": 1,
                "rate": 0.0,
                "num_requests": 20,
                "mix": False,
                "prompt_tokens": 16,
                "output_tokens": 2,
            },
            [
                ("short-prompt TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]),
                ("short-prompt TTFT p90 ms", lambda r: r["ttft_ms"]["p90"]),
            ],
        ),
        "cold": (
            {
                "concurrency": 1,
                "rate": 0.0,
                "num_requests": 3,
                "mix": False,
                "prompt_tokens": args.cold_tokens,
                "output_tokens": 1,
            },
            [(f"cold {args.cold_tokens}-token TTFT p50 ms", lambda r: r["ttft_ms"]["p50"])],
        ),
        "turn2": (
            {"concurrency": 1, "rate": 0.0, "num_requests": 6, "mix": False, "two_turn": True},
            [
                ("2nd-turn TTFT p50 ms", lambda r: r["second_turn_ttft_ms"]["p50"]),
                ("1-turn TTFT p50 ms (the new turn alone)", lambda r: r["one_turn_ttft_ms"]["p50"]),
                ("2nd-turn / 1-turn TTFT", lambda r: r["turn_ratio"]),
            ],
        ),
        "open": (
            {
                "concurrency": 1,
                "rate": args.rate or 12.0,
                "mix": True,
                "output_tokens": args.open_output_tokens,
            },
            [
                ("open-loop goodput", lambda r: r["goodput"]),
                ("open-loop TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]),
                ("open-loop TTFT p99 ms", lambda r: r["ttft_ms"]["p99"]),
                ("open-loop ITL p50 ms", lambda r: r["itl_ms"]["p50"]),
                ("open-loop ITL p99 ms", lambda r: r["itl_ms"]["p99"]),
            ],
        ),
    }


def compare(args) -> int:
    """Run the chosen workloads against ours then the peer, back to back; print a table with ratios."""
    table = suite(args)
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in table]
    if unknown:
        print(f"error: unknown workload(s) {unknown}; choose from {list(table)}", file=sys.stderr)
        return 2
    sides = {"ours": (args.base_url, args.api_key, args.model), "peer": (args.peer, args.peer_api_key, "")}
    rows: list[tuple[str, float | None, float | None]] = []
    raw: dict[str, dict] = {}
    failed = False
    for name in names:
        overrides, figures = table[name]
        got = {}
        for side, (url, key, model) in sides.items():
            ns = argparse.Namespace(
                **{**vars(args), **overrides, "base_url": url, "api_key": key, "model": model}
            )
            got[side] = trio.run(run, ns)
            failed |= got[side]["errors"] > 0
            print(
                f"  {name} {side}: {got[side]['ok']}/{got[side]['requests']} ok, "
                f"wall {got[side]['wall_s']:.1f}s",
                flush=True,
            )
        raw[name] = got
        for label, read in figures:
            rows.append((label, read(got["ours"]), read(got["peer"])))
    load = os.getloadavg()[0]
    print(f"\n| figure | ours | {args.peer_name} | ours / {args.peer_name} |\n|---|---|---|---|")
    for label, a, b in rows:
        ratio = "-" if a is None or not b else f"{a / b:.2f}x"
        fa = "-" if a is None else f"{a:.2f}"
        fb = "-" if b is None else f"{b:.2f}"
        print(f"| {label} | {fa} | {fb} | {ratio} |")
    print(f"\nload average {load:.2f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "runs": raw, "load_avg_end": load}, f, indent=2, default=str)
    return 1 if failed else 0


# ---------------------------------------------------------------------- --speculative: off vs on


def _spec_sets(args) -> dict[str, list[tuple[str, list[dict]]]]:
    """``bench/spec_prompts.py``'s sets (loaded next to this file), the first ``--spec-prompts`` of each."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from spec_prompts import SETS

    n = args.spec_prompts or None
    return {s: items[:n] for s, items in SETS.items() if s in args.spec_sets.split(",")}


async def _model_id(client: httpx.AsyncClient, url: str, key: str) -> str:
    """The first model ``url`` serves (waits up to a minute for a server still loading its model)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = None
    for _ in range(120):
        r = await client.get(url.rstrip("/") + "/v1/models", headers=headers)
        if r.status_code == 200:
            break
        await trio.sleep(0.5)
    data = r.json()
    return (data.get("data") or data.get("models"))[0].get("id") or "default"


async def _admin_spec(client: httpx.AsyncClient, args) -> tuple[int, int, int, list[int]] | None:
    """The gateway's summed speculation counters (``/admin/v1/stats``), or None without ``--admin-key``."""
    if not args.admin_key:
        return None
    r = await client.get(
        args.base_url.rstrip("/") + "/admin/v1/stats", headers={"Authorization": f"Bearer {args.admin_key}"}
    )
    if r.status_code != 200:
        print(f"  /admin/v1/stats: HTTP {r.status_code}; no per-position figures", file=sys.stderr)
        return None
    d = r.json()
    return (
        d.get("spec_drafts", 0),
        d.get("spec_draft_tokens", 0),
        d.get("spec_accepted_tokens", 0),
        list(d.get("spec_accepted_per_pos") or []),
    )


def _per_pos(before, after) -> list[float] | None:
    """Per-position acceptance between two ``_admin_spec`` snapshots: accepted at j / verify chunks."""
    if before is None or after is None:
        return None
    drafts = after[0] - before[0]
    if drafts <= 0:
        return []
    return [(a - (before[3][j] if j < len(before[3]) else 0)) / drafts for j, a in enumerate(after[3])]


def _decode_tok_s(results: list[Result]) -> float | None:
    """Completion tokens after the first / time from the first content to the end, summed over ``results``."""
    toks = sum(max(0, r.completion_tokens - 1) for r in results if r.ok)
    secs = sum(r.e2e - r.ttft for r in results if r.ok and r.e2e is not None and r.ttft is not None)
    return toks / secs if secs else None


def _e2e_tok_s(results: list[Result]) -> float | None:
    toks = sum(r.completion_tokens for r in results if r.ok)
    secs = sum(r.e2e for r in results if r.ok and r.e2e is not None)
    return toks / secs if secs else None


async def spec_run(args) -> dict:
    """The ``--speculative`` runs (see the module docstring); returns rows per (set, sampling)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        ours_model = args.model or await _model_id(client, args.base_url, args.api_key)
        variants = [
            ("off", args.base_url, args.api_key, ours_model, {"speculative": False}),
            ("on", args.base_url, args.api_key, ours_model, {}),
        ]
        if args.peer:
            peer_model = await _model_id(client, args.peer, args.peer_api_key)
            variants.append(("peer", args.peer, args.peer_api_key, peer_model, {}))
        sets = _spec_sets(args)
        samplings = [("greedy", 0.0)] + ([("T=0.8 seeded", 0.8)] if args.spec_sampled else [])

        def ns(url: str, key: str, model: str, temperature: float, max_tokens: int) -> argparse.Namespace:
            return argparse.Namespace(
                **{
                    **vars(args),
                    "base_url": url,
                    "api_key": key,
                    "model": model,
                    "temperature": temperature,
                    "output_tokens": max_tokens,
                    "mix": False,
                }
            )

        first = next(iter(sets.values()))[0][1]
        for w in range(args.warmup):
            for _, url, key, model, extra in variants:
                await one(client, ns(url, key, model, 0.0, 16), -1 - w, random.Random(0), first, extra)
        rows = []
        mismatches: list[str] = []
        for set_name, items in sets.items():
            for label, temp in samplings:
                before = await _admin_spec(client, args)
                got: dict[str, list[Result]] = {v[0]: [] for v in variants}
                for j, (pname, msgs) in enumerate(items):
                    # the prompt once with max_tokens 1 first, so that off, on and the peer all find it in
                    # their prefix caches (the tenant's cache salt is the same for off and on): end-to-end
                    # figures then compare like with like
                    for _, url, key, model, extra in variants:
                        await one(client, ns(url, key, model, 0.0, 1), j, random.Random(j), msgs, extra)
                    for name, url, key, model, extra in variants:
                        body_extra = {**extra, **({"seed": 1000 + j} if temp else {})}
                        r = await one(
                            client,
                            ns(url, key, model, temp, args.output_tokens),
                            j,
                            random.Random(j),
                            msgs,
                            body_extra,
                        )
                        got[name].append(r)
                        if not r.ok:
                            print(f"  {set_name}/{pname} {name}: error {r.status} {r.error}", file=sys.stderr)
                    off, on = got["off"][-1], got["on"][-1]
                    same = off.ok and on.ok and off.text == on.text
                    if off.ok and on.ok and not same:
                        n = next(
                            (i for i, (a, b) in enumerate(zip(off.text, on.text)) if a != b),
                            min(len(off.text), len(on.text)),
                        )
                        msg = (
                            f"MISMATCH: {set_name}/{pname} ({label}): the text differs with speculation on "
                            f"(first difference at character {n}; {off.completion_tokens} vs "
                            f"{on.completion_tokens} tokens)"
                        )
                        mismatches.append(msg)
                        print("!!! " + msg, file=sys.stderr, flush=True)
                    parts = [f"{v}: {_decode_tok_s([got[v][-1]]) or 0:.1f}" for v in got if got[v][-1].ok]
                    print(
                        f"  {set_name:8s} {label:12s} {pname:14s} {on.prompt_tokens:4d} prompt / "
                        f"{on.completion_tokens:4d} out tokens, decode tok/s {', '.join(parts)}; accepted "
                        f"{on.accepted_tokens}/{on.draft_tokens}{'' if same else '  MISMATCH'}",
                        file=sys.stderr,
                        flush=True,
                    )
                after = await _admin_spec(client, args)
                on_ok = [r for r in got["on"] if r.ok]
                drafted = sum(r.draft_tokens or 0 for r in on_ok)
                accepted = sum(r.accepted_tokens or 0 for r in on_ok)
                row = {
                    "set": set_name,
                    "sampling": label,
                    "prompts": len(items),
                    "errors": sum(1 for v in got.values() for r in v if not r.ok),
                    "output_tokens": sum(r.completion_tokens for r in on_ok),
                    "identical": all(
                        a.ok and b.ok and a.text == b.text for a, b in zip(got["off"], got["on"])
                    ),
                    "draft_tokens": drafted,
                    "accepted_tokens": accepted,
                    "acceptance_rate": accepted / drafted if drafted else None,
                    "acceptance_per_pos": _per_pos(before, after),
                    "off_draft_tokens": sum(r.draft_tokens or 0 for r in got["off"] if r.ok),
                }
                for v in got:
                    row[f"{v}_tok_s"] = _decode_tok_s(got[v])
                    row[f"{v}_e2e_tok_s"] = _e2e_tok_s(got[v])
                    row[f"{v}_ttft_ms"] = summary([r.ttft for r in got[v] if r.ok and r.ttft is not None])[
                        "p50"
                    ]
                rows.append(row)
    return {"rows": rows, "mismatches": mismatches, "peer": bool(args.peer)}


def speculative_main(args) -> int:
    """``--speculative``: run, print the table, write ``--json``; 1 on errors or a mismatch."""
    res = trio.run(spec_run, args)

    def f(x, fmt=".1f"):
        return "-" if x is None else format(x, fmt)

    def ratio(a, b):
        return "-" if a is None or not b else f"{a / b:.2f}x"

    peer = res["peer"]
    head = "| set | sampling | prompts | out tokens | off tok/s | on tok/s | on / off |"
    sep = "|---|---|---|---|---|---|---|"
    if peer:
        head += f" {args.peer_name} tok/s | on / {args.peer_name} |"
        sep += "---|---|"
    head += " e2e tok/s off / on | accepted / drafted | acceptance | per position | same text |"
    sep += "---|---|---|---|---|"
    lines = [
        f'speculation through {args.base_url}: off = body extra "speculative": false, on = the default; '
        f"max_tokens {args.output_tokens}{', ignore_eos' if args.ignore_eos else ''}; one request at a time",
        "",
        head,
        sep,
    ]
    for r in res["rows"]:
        line = (
            f"| {r['set']} | {r['sampling']} | {r['prompts']} | {r['output_tokens']} | {f(r['off_tok_s'])} | "
            f"{f(r['on_tok_s'])} | {ratio(r['on_tok_s'], r['off_tok_s'])} |"
        )
        if peer:
            line += f" {f(r['peer_tok_s'])} | {ratio(r['on_tok_s'], r['peer_tok_s'])} |"
        pos = r["acceptance_per_pos"]
        line += (
            f" {f(r['off_e2e_tok_s'])} / {f(r['on_e2e_tok_s'])} | {r['accepted_tokens']} / {r['draft_tokens']} | "
            f"{f(r['acceptance_rate'], '.2f')} | {' '.join(f'{x:.2f}' for x in pos) if pos else '-'} | "
            f"{'yes' if r['identical'] else 'MISMATCH'} |"
        )
        lines.append(line)
    print("\n".join(lines))
    print(
        "\n- tok/s: completion tokens after the first / time from the first content to the end, summed over the "
        "set's prompts; e2e tok/s: completion tokens / request time\n- acceptance: accepted_tokens / "
        "draft_tokens of the responses' timings; per position (with --admin-key): verify chunks whose draft "
        "token j was accepted / verify chunks, from /admin/v1/stats"
    )
    for m in res["mismatches"]:
        print(f"!!! {m}")
    errors = sum(r["errors"] for r in res["rows"])
    if errors:
        print(f"{errors} requests failed", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            cfg = {k: v for k, v in vars(args).items() if k not in ("api_key", "peer_api_key", "admin_key")}
            json.dump({"config": cfg, **res}, fh, indent=2)
    return 1 if errors or res["mismatches"] else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    ap.add_argument("--model", default="")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=int, default=1, help="closed loop: this many streams at a time")
    g.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson arrivals, requests/s")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument(
        "--output-tokens",
        type=int,
        default=None,
        help="max_tokens of each request (default 64; 128 with --speculative)",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        default=None,
        help="stop at EOS (the default with --speculative; otherwise ignore_eos is sent)",
    )
    ap.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", help="send ignore_eos (default)")
    ap.add_argument("--mix", action="store_true", help="mixed prompt lengths and a shared document")
    ap.add_argument("--mix-lengths", default="32,128,512", help="prompt lengths of --mix (tokens)")
    ap.add_argument("--shared-doc-tokens", type=int, default=600)
    ap.add_argument("--shared-fraction", type=float, default=1 / 3)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput: TTFT limit (ms)")
    ap.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput: per-request ITL p99 limit (ms)")
    ap.add_argument("--peer", default=None, metavar="URL", help="run the suite against this server too")
    ap.add_argument("--peer-name", default="peer")
    ap.add_argument("--peer-api-key", default="")
    ap.add_argument("--peer-concurrency", type=int, default=32)
    ap.add_argument("--workloads", default="closed1,closedN,short,cold,open")
    ap.add_argument("--cold-tokens", type=int, default=2000)
    ap.add_argument("--turn-tokens", type=int, default=512, help="turn2: the first turn's prompt (tokens)")
    ap.add_argument("--open-output-tokens", type=int, default=96)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="write the results here")
    sp = ap.add_argument_group("speculative decoding (--speculative)")
    sp.add_argument(
        "--speculative",
        action="store_true",
        help='the grounded and open prompt sets one at a time, with "speculative": false then the default '
        "(and against --peer without the field); instead of the load runs",
    )
    sp.add_argument("--spec-sets", default="grounded,open", help="prompt sets of bench/spec_prompts.py")
    sp.add_argument(
        "--spec-prompts", type=int, default=0, help="only the first N prompts of each set (0: all)"
    )
    sp.add_argument("--spec-sampled", action="store_true", help="also temperature 0.8 with a fixed seed")
    sp.add_argument(
        "--admin-key",
        default=os.environ.get("LLM_GATEWAY_ADMIN_KEY", ""),
        help="read per-position acceptance from /admin/v1/stats (default $LLM_GATEWAY_ADMIN_KEY)",
    )
    args = ap.parse_args(argv)
    if args.output_tokens is None:
        args.output_tokens = 128 if args.speculative else 64
    if args.ignore_eos is None:
        args.ignore_eos = not args.speculative
    if args.speculative:
        return speculative_main(args)
    if args.peer:
        return compare(args)
    res = trio.run(run, args)
    mode = f"rate {args.rate}/s" if args.rate else f"concurrency {args.concurrency}"
    print(f"{mode}: {res['ok']}/{res['requests']} ok, {res['errors']} errors, wall {res['wall_s']:.1f}s")
    print(
        f"  throughput: {res['request_throughput_rps']:.3f} req/s, {res['output_tokens_per_s']:.1f} output tokens/s"
    )
    if args.rate:
        print(
            f"  goodput: {res['goodput']:.3f} (TTFT <= {args.slo_ttft_ms:g} ms, ITL p99 <= {args.slo_itl_ms:g} ms); "
            f"missed: {res['slo_misses']}"
        )
    for k in (
        "ttft_ms",
        "tpot_ms",
        "itl_ms",
        "request_itl_p99_ms",
        "e2e_ms",
        "backend_ttft_ms",
        "gateway_overhead_ms",
        "gateway_internal_ms",
        "gateway_prep_ms",
    ):
        print(f"  {k:20s} {_fmt(res[k])}")
    for s in res["error_samples"]:
        print(f"  error: {s}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
