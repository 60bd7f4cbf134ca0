"""Added latency of auth + admission per request (microseconds, p50/p99), in-process and with Redis.

One request = ``authenticate`` (Bearer key -> SHA-256 -> cached lookup -> checks) + ``admit`` enter
(check+reserve rpm, tpm, max_concurrent, daily_tokens) + ``finish`` + exit (true-up + ledger row queued).
Sequential requests on one Trio task, so the numbers are per-request latency, not throughput.
The Redis run starts its own ``redis-server`` on a free loopback port (skipped if not installed).

    .venv/bin/python bench/admission.py [--n 20000] [--append-perf]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.tenants import Tenants  # noqa: E402
from ratelimit.core import Limits  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def run(db: str, redis_url: str | None, n: int, concurrency: int) -> dict[str, float]:
    async with Tenants(db, redis_url=redis_url, announce=lambda s: None).running() as t:
        lim = Limits(rpm=10**9, tpm=10**12, max_concurrent=10**6, daily_tokens=10**15)
        tn = await t.store.create_tenant(f"bench-{time.time_ns()}", lim)
        key, _ = await t.store.create_key(tn.id)
        scope = {
            "type": "http",
            "headers": [(b"authorization", f"Bearer {key}".encode())],
            "query_string": b"",
        }
        lat: list[float] = []
        enter: list[float] = []

        async def one() -> None:
            t0 = time.perf_counter_ns()
            p = await t.authenticate(scope["headers"])
            async with t.admit(p, prompt_tokens=100, max_tokens=200, model="bench") as r:
                enter.append((time.perf_counter_ns() - t0) / 1000)  # what a client waits before generation
                r.finish(completion_tokens=50, finish_reason="stop", status=200)
            lat.append((time.perf_counter_ns() - t0) / 1000)

        for _ in range(min(500, n)):  # warm-up (cache, script load, seeding)
            await one()
        lat.clear()
        enter.clear()
        t_start = time.perf_counter()
        if concurrency <= 1:
            for _ in range(n):
                await one()
        else:
            per = n // concurrency

            async def worker():
                for _ in range(per):
                    await one()

            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)
        wall = time.perf_counter() - t_start
        await t.ledger.flush()
        return {
            "enter_p50_us": pct(enter, 50),
            "enter_p99_us": pct(enter, 99),
            "p50_us": pct(lat, 50),
            "p99_us": pct(lat, 99),
            "mean_us": sum(lat) / len(lat),
            "req_per_s": len(lat) / wall,
            "n": len(lat),
        }


def start_redis(d: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            d,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--append-perf", action="store_true", help="append the numbers to docs/perf.md")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for conc in (1, 32):
            rows.append(
                ("in-process", conc, trio.run(run, os.path.join(d, f"a{conc}.db"), None, args.n, conc))
            )
        if shutil.which("redis-server"):
            proc, url = start_redis(d)
            try:
                for conc in (1, 32):
                    rows.append(
                        ("redis", conc, trio.run(run, os.path.join(d, f"b{conc}.db"), url, args.n, conc))
                    )
            finally:
                proc.terminate()
                proc.wait(5)
    lines = [
        f"| {mode} | {conc} | {r['enter_p50_us']:.0f} | {r['enter_p99_us']:.0f} | {r['p50_us']:.0f} | {r['p99_us']:.0f} "
        f"| {r['mean_us']:.0f} | {r['req_per_s']:.0f} |"
        for mode, conc, r in rows
    ]
    table = "\n".join(
        [
            "| limiter | concurrent tasks | admission p50 µs | admission p99 µs | full p50 µs | full p99 µs "
            "| full mean µs | req/s |",
            "|---|---|---|---|---|---|---|---|",
            *lines,
        ]
    )
    print(table)
    if args.append_perf:
        cpu = ""
        try:
            cpu = next(
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            )
        except Exception:
            cpu = platform.processor()
        entry = (
            f"\n## Tenancy: auth + admission latency ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)\n\n"
            f"Machine: {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"redis-server local loopback; load average at the end {os.getloadavg()[0]:.1f} "
            f"(shared machine: p99 is dominated by other processes when the load is high).\nCommand: `.venv/bin/python bench/admission.py --n {args.n} --append-perf`\n"
            f"Per request: authenticate + admit (rpm, tpm, max_concurrent, daily_tokens) + finish + true-up; "
            f'"admission" = authenticate + admit entry (what a client waits before generation starts), '
            f'"full" = including the true-up at the end; n={args.n}.\n\n{table}\n'
        )
        with open(ROOT / "docs" / "perf.md", "a") as f:
            f.write(entry)


if __name__ == "__main__":
    main()
