"""Serving benchmark: streaming load against any OpenAI-compatible ``/v1/chat/completions`` (httpx on Trio).

Usage::

    python bench/serve.py --base-url http://127.0.0.1:8000 --api-key $KEY \\
        --concurrency 32 --num-requests 128 --prompt-tokens 128 --output-tokens 64 --json out.json
    python bench/serve.py ... --rate 12 --mix      # open loop: Poisson arrivals, mixed prompts, goodput
    python bench/serve.py ... --peer http://127.0.0.1:8080   # every workload against both, ratios

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
ours / peer. ``--workloads`` picks some of ``closed1,closedN,short,cold,open``.

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


async def one(client: httpx.AsyncClient, args, i: int, rng: random.Random) -> Result:
    res = Result(start=time.perf_counter())
    body = {
        "model": args.model,
        "messages": messages_for(args, i, rng),
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
    ap.add_argument("--open-output-tokens", type=int, default=96)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
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
