"""Serving benchmark: streaming load against any OpenAI-compatible ``/v1/chat/completions`` (httpx on Trio).

Usage::

    python bench/serve.py --base-url http://127.0.0.1:8000 --api-key $KEY \\
        --concurrency 32 --num-requests 128 --prompt-tokens 128 --output-tokens 64 --json out.json
    python bench/serve.py ... --rate 4            # open loop: Poisson arrivals, 4 requests/s

Each request streams (``stream_options.include_usage``) a synthetic prompt of about ``--prompt-tokens``
tokens (distinct per request, so the prefix cache does not serve it) and asks for exactly
``--output-tokens`` tokens (``ignore_eos``, an extension most OpenAI-compatible servers accept; turn it
off with ``--no-ignore-eos``).

Printed and written to JSON (times in milliseconds):
* request throughput (req/s) and output token throughput (tokens/s) over the whole run;
* TTFT (request sent -> first content byte), TPOT ((e2e - TTFT) / (completion_tokens - 1)),
  ITL (gaps between content chunks), e2e latency: mean, p50, p90, p99;
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


def make_prompt(n_tokens: int, i: int, rng: random.Random) -> str:
    """About ``n_tokens`` tokens for byte-level BPE tokenizers (one common word + space is one token)."""
    head = f"Request {i}: "
    return head + " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens - 12)))


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


async def one(client: httpx.AsyncClient, args, i: int, rng: random.Random) -> Result:
    res = Result(start=time.perf_counter())
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": make_prompt(args.prompt_tokens, i, rng)}],
        "max_tokens": args.output_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
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
                    if (c.get("delta") or {}).get("content"):
                        if res.ttft is None:
                            res.ttft = now - res.start
                        elif last is not None:
                            res.itl.append(now - last)
                        last = now
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
        res.e2e = time.perf_counter() - res.start
        res.ok = res.ttft is not None
        if not res.ok:
            res.error = "no content received"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run(args) -> dict:
    limits = httpx.Limits(
        max_connections=max(args.concurrency, 256), max_keepalive_connections=max(args.concurrency, 256)
    )
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        if not args.model:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            r = await client.get(args.base_url.rstrip("/") + "/v1/models", headers=headers)
            args.model = r.json()["data"][0]["id"]
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
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    res = trio.run(run, args)
    mode = f"rate {args.rate}/s" if args.rate else f"concurrency {args.concurrency}"
    print(f"{mode}: {res['ok']}/{res['requests']} ok, {res['errors']} errors, wall {res['wall_s']:.1f}s")
    print(
        f"  throughput: {res['request_throughput_rps']:.3f} req/s, {res['output_tokens_per_s']:.1f} output tokens/s"
    )
    for k in (
        "ttft_ms",
        "tpot_ms",
        "itl_ms",
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
