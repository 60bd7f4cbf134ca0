"""Time ``ModelRunner.execute`` alone (no engine, no sampling): decode batches and a long prefill.

For each dtype: decode steps of B sequences (one new token each, every sequence with ``--context``
cached tokens, distinct block tables) for each B in ``--batches``, then one prefill of
``--prefill`` tokens. Reports the median and best step time and tokens/s, and, with ``--profile``,
where a single-stream decode step's time goes (matmul kernels vs everything else, from
``torch.profiler``). ``--append`` adds a dated entry to docs/perf.md.

Usage::

    .venv/bin/python bench/model_step.py                       # fp32 + bf16, B = 1, 8, 32, 64
    .venv/bin/python bench/model_step.py --dtypes bfloat16 --batches 1 --profile
    .venv/bin/python bench/model_step.py --append              # also write docs/perf.md
    .venv/bin/python bench/model_step.py --dtypes float32 --generated-int4 --isas all --batches 1,4,32

``--isas`` runs the whole measurement once per CPU ISA (``LLM_GATEWAY_CPU_ISA``, each in its own process so
that ATen and oneDNN are capped to it as well; ``all``: every ISA this CPU runs). ``--generated-int4``
times the decode rows as generated tokens through the row-invariant int4 matmul (``q4_gemm``; the prefill
stays prompt rows, dense).

The machine is shared: the load average before/after is printed, and is part of the perf entry.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend import cpu_isa  # noqa: E402

cpu_isa.apply()  # before torch: a forced ISA caps ATen and oneDNN too

import torch  # noqa: E402

from backend.batch import SeqChunk  # noqa: E402
from backend.model_path import default_model_path  # noqa: E402
from backend.model_runner import ModelRunner  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402  (bench/machine.py)

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu", "aten::linear")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time(fn, steps: int, warmup: int = 2) -> list[float]:
    """Wall time of ``fn()`` per call (seconds), device-synchronized."""
    for _ in range(warmup):
        fn()
    _sync()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def _report(dtype: str, label: str, ts: list[float], tokens: int) -> str:
    """Print one timing line (median / best of ``ts`` seconds, ``tokens`` per call) and return its table row."""
    med, best = statistics.median(ts), min(ts)
    print(
        f"[{dtype}] {label}: median {med * 1e3:.1f} ms  best {best * 1e3:.1f} ms  -> {tokens / med:.1f} tok/s "
        f"(best {tokens / best:.1f})",
        flush=True,
    )
    return f"| {dtype} | {label} | {med * 1e3:.1f} ms (best {best * 1e3:.1f}) | {tokens / med:.1f} tok/s (best {tokens / best:.1f}) | |"


def bench_dtype(args, dtype: str) -> list[str]:
    label = f"{dtype} {cpu_isa.selected() or 'generic'}" + (" int4-generated" if args.generated_int4 else "")
    bs = 16
    ctx = args.context
    max_b = max(args.batches)
    ctx_blocks = -(-(ctx + 1) // bs)
    need = max_b * ctx_blocks + -(-args.prefill // bs) + 1
    t0 = time.perf_counter()
    r = ModelRunner(
        args.model,
        dtype=dtype,
        block_size=bs,
        num_kv_blocks=need,
        device=args.device,
        attention_backend=args.attention,
        generated_int4=True if args.generated_int4 else None,
    )
    if args.generated_int4 and not r.generated_int4:
        raise SystemExit(f"[{label}] --generated-int4: not available here (no 4-bit GGUF or no q4_gemm)")
    dtype = label
    load_s = time.perf_counter() - t0
    rows = [f"| {dtype} | load | {load_s:.1f} s | | |"]
    print(f"[{dtype}] loaded in {load_s:.1f}s, {r.num_kv_blocks} KV blocks", flush=True)
    # fill every sequence's context once (one prefill each, chunked to bound memory)
    prompt = [(i * 37) % 4000 + 100 for i in range(ctx)]
    tables = [list(range(i * ctx_blocks, (i + 1) * ctx_blocks)) for i in range(max_b)]
    for i in range(max_b):
        r.execute([SeqChunk(prompt, 0, tables[i], False)])
    for B in args.batches:
        chunks = [SeqChunk([5 + i], ctx, tables[i], True, prompt_len=ctx) for i in range(B)]
        ts = _time(functools.partial(r.execute, chunks), args.steps)
        rows.append(_report(dtype, f"decode B={B} (ctx {ctx})", ts, B))
    if args.prefill:
        base = max_b * ctx_blocks
        pt = list(range(base, base + -(-args.prefill // bs)))
        ids = [(i * 91) % 30000 + 50 for i in range(args.prefill)]
        prefill = [SeqChunk(ids, 0, pt, True)]
        ts = _time(functools.partial(r.execute, prefill), max(1, args.steps // 5), warmup=1)
        rows.append(_report(dtype, f"prefill {args.prefill} tokens", ts, args.prefill))
    if args.profile:
        from torch.profiler import profile

        chunk = [SeqChunk([5], ctx, tables[0], True, prompt_len=ctx)]
        _time(functools.partial(r.execute, chunk), 2)
        n = 10
        with profile() as prof:
            for _ in range(n):
                r.execute(chunk)
        total = mm = 0.0
        calls = 0
        for ev in prof.key_averages():
            total += ev.self_cpu_time_total
            calls += ev.count
            if ev.key in MATMUL_OPS:
                mm += ev.self_cpu_time_total
        step_ms = total / n / 1e3
        print(
            f"[{dtype}] B=1 profile: {step_ms:.1f} ms/step of op self-time, matmul {mm / n / 1e3:.1f} ms "
            f"({100 * mm / max(total, 1):.0f}%), other ops {(total - mm) / n / 1e3:.1f} ms; "
            f"{calls / n:.0f} op calls/step",
            flush=True,
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        rows.append(
            f"| {dtype} | B=1 profile | matmul {mm / n / 1e3:.1f} ms + other ops {(total - mm) / n / 1e3:.1f} ms"
            f" | {calls / n:.0f} op calls/step | |"
        )
    del r
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: the default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention", default="torch", help="attention backend: torch or cupy")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=128, help="cached tokens per decode sequence")
    ap.add_argument("--prefill", type=int, default=2000, help="prefill length (0: skip)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per decode batch size")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--profile", action="store_true", help="profile a B=1 decode step")
    ap.add_argument(
        "--generated-int4", action="store_true", help="decode rows through q4_gemm (generated rows)"
    )
    ap.add_argument(
        "--isas", default=None, help="comma-separated CPU ISAs to run each in a child process, or 'all'"
    )
    ap.add_argument("--rows-json", action="store_true", help=argparse.SUPPRESS)  # a child's table rows
    ap.add_argument("--append", action="store_true", help="append the results to docs/perf.md")
    ap.add_argument("--perf-file", default=None, help="append the entry to this file instead of docs/perf.md")
    args = ap.parse_args()
    args.model = args.model or default_model_path()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    rows: list[str] = []
    if args.isas:
        rows = _per_isa(args)
    else:
        for dt in args.dtypes.split(","):
            rows += bench_dtype(args, dt)
    if args.rows_json:
        print("ROWS " + json.dumps(rows))
        return
    load1 = os.getloadavg()
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f}")
    if args.append or args.perf_file:
        cmd = "python bench/model_step.py " + " ".join(sys.argv[1:])
        entry = [
            "",
            f"## model step (ModelRunner.execute) — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"- machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), device {args.device}"
            + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
            + f", attention {args.attention}",
            f"- model: {Path(args.model).name}; command: `{cmd}`",
            f"- load average (1 min) before/after: {load0[0]:.2f} / {load1[0]:.2f} (shared machine)",
            "",
            "| dtype | case | step time | throughput | |",
            "|---|---|---|---|---|",
            *rows,
            "",
        ]
        perf = Path(args.perf_file) if args.perf_file else ROOT / "docs" / "perf.md"
        if not perf.exists():
            perf.write_text("# Performance measurements\n")
        with perf.open("a") as f:
            f.write("\n".join(entry))
        print(f"appended to {perf}")


def _per_isa(args) -> list[str]:
    """Run this script once per ISA of ``args.isas`` (a child process each, ``LLM_GATEWAY_CPU_ISA`` set);
    returns their table rows in order."""
    isas = cpu_isa.supported() if args.isas == "all" else args.isas.split(",")
    argv, skip = [], False
    for a in sys.argv[1:]:  # the same options, less the ones the parent handles
        if skip:
            skip = False
        elif a in ("--isas", "--perf-file"):
            skip = True
        elif not (a.startswith("--isas=") or a.startswith("--perf-file=") or a == "--append"):
            argv.append(a)
    rows: list[str] = []
    for isa in isas:
        env = {**os.environ, cpu_isa.SETTING: isa}
        for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
            env.pop(k, None)  # the child's cpu_isa.apply() sets them for its ISA
        out = subprocess.run(
            [sys.executable, __file__, *argv, "--rows-json"], env=env, stdout=subprocess.PIPE, text=True
        )
        for line in out.stdout.splitlines():
            if line.startswith("ROWS "):
                rows += json.loads(line[5:])
            else:
                print(line, flush=True)
        if out.returncode:
            raise SystemExit(f"{isa}: exit {out.returncode}")
    return rows


if __name__ == "__main__":
    main()
