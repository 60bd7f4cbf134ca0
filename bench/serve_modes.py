"""The served modes side by side through HTTP: one gateway per ``--dtype``, ``bench/serve.py`` at each concurrency.

Usage::

    python bench/serve_modes.py [--dtypes default,float32] [--concurrency 1,32] [--prompt-tokens 128]
        [--output-tokens 128] [--requests-per-stream 2] [--peer-url http://127.0.0.1:8080 --peer-name llama-server]
        [--append-perf]

For each dtype (``default`` = no ``--dtype`` flag, what ``make serve`` runs) it starts
``python -m gateway serve`` on a free loopback port with a fresh SQLite tenancy database and an admin key,
creates a tenant key through the admin API, runs ``bench/serve.py``'s closed loop (streaming, distinct
prompts, ``ignore_eos``) at each concurrency with ``max(8, concurrency * requests-per-stream)`` requests,
and stops the gateway. With ``--peer-url`` an OpenAI-compatible server that is already running (e.g.
``llama-server -m <same GGUF> -np 32 -t <cores>``) is measured the same way in the same run, so each mode's
figures read as a ratio to the peer's. Prints a markdown table (output tokens/s, TTFT, TPOT, ITL in ms) and with
``--append-perf`` appends it to ``docs/perf.md`` with the date, machine and command.

Exit status 1 when a gateway does not start or a run has errors.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve as serve_bench  # noqa: E402  (bench/serve.py)
from machine import cpu_name  # noqa: E402  (bench/machine.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(dtype: str, tmp: str) -> tuple[subprocess.Popen, str, str, str]:
    """Start a gateway; returns ``(process, base_url, api_key, served dtype)``.

    Raises:
        RuntimeError: it exited or was not ready within 300 s.
    """
    port, admin = _free_port(), "adm-" + os.urandom(8).hex()
    cmd = [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--admin-key",
        admin,
        "--db",
        os.path.join(tmp, f"bench-{dtype}.db"),
    ] + ([] if dtype == "default" else ["--dtype", dtype])
    log_path = os.path.join(tmp, f"gateway-{dtype}.log")
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gateway ({dtype}) did not start; log: {log_path}")
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    try:
        a = {"Authorization": f"Bearer {admin}"}
        tid = httpx.post(base + "/admin/v1/tenants", json={"name": "bench"}, headers=a, timeout=30).json()[
            "id"
        ]
        key = httpx.post(
            base + f"/admin/v1/tenants/{tid}/keys", json={"name": "bench"}, headers=a, timeout=30
        ).json()["key"]
        models = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    except BaseException:
        proc.terminate()  # its backend exits with it (PR_SET_PDEATHSIG)
        proc.wait(60)
        raise
    return proc, base, key, models["data"][0]["dtype"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="default,float32")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--peer-url", default=None, help="also measure this running OpenAI-compatible server")
    ap.add_argument("--peer-name", default="peer")
    ap.add_argument("--append-perf", action="store_true", help="append the table to docs/perf.md")
    args = ap.parse_args()
    rows: list[str] = []
    failed = False
    tmp = tempfile.mkdtemp(prefix="bench-modes-")

    def measure(label: str, base: str, key: str) -> None:
        nonlocal failed
        for c in (int(x) for x in args.concurrency.split(",")):
            res = trio.run(
                serve_bench.run, serve_bench_args(base, key, c, max(8, c * args.requests_per_stream), args)
            )
            failed |= res["errors"] > 0
            t, p, i = res["ttft_ms"], res["tpot_ms"], res["itl_ms"]
            rows.append(
                f"| {label} | {c} | {res['ok']}/{res['requests']} | {res['output_tokens_per_s']:.1f} | "
                f"{t['p50']:.0f} / {t['p99']:.0f} | {p['p50']:.1f} | {i['p50']:.1f} / {i['p99']:.1f} |"
            )
            print(rows[-1], flush=True)

    if args.peer_url:
        measure(args.peer_name, args.peer_url, "")
    for dtype in args.dtypes.split(","):
        proc, base, key, served = start(dtype, tmp)
        try:
            measure(f"{served} ({'default' if dtype == 'default' else '--dtype ' + dtype})", base, key)
        finally:
            proc.terminate()
            proc.wait(60)
    head = (
        "| mode | streams | ok | out tok/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p50 / p99 ms |\n"
        "|---|---|---|---|---|---|---|"
    )
    table = head + "\n" + "\n".join(rows)
    print(table)
    if args.append_perf:
        load = os.getloadavg()[0]
        cmd = "python bench/serve_modes.py " + " ".join(sys.argv[1:])
        entry = (
            f"\n### HTTP serve bench by mode {datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n\n"
            f"- machine: {cpu_name()}, {platform.machine()}, {os.cpu_count()} CPUs, load avg {load:.1f} at the end\n"
            f"- command: `{cmd}` (prompt {args.prompt_tokens} / output {args.output_tokens} tokens, streaming, closed loop)\n\n"
            f"{table}\n"
        )
        with open(ROOT / "docs" / "perf.md", "a") as f:
            f.write(entry)
    return 1 if failed else 0


def serve_bench_args(
    base: str, key: str, concurrency: int, n: int, args: argparse.Namespace
) -> argparse.Namespace:
    """The namespace ``bench/serve.py``'s ``run`` reads, for a closed loop of ``n`` requests."""
    return argparse.Namespace(
        base_url=base,
        api_key=key,
        model="",
        concurrency=concurrency,
        rate=0.0,
        num_requests=n,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        temperature=0.0,
        ignore_eos=True,
        warmup=2,
        seed=0,
        timeout=600.0,
        json=None,
    )


if __name__ == "__main__":
    sys.exit(main())
