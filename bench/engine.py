"""In-process engine benchmark (no HTTP, no sockets): decode and prefill throughput, TTFT.

Measures, on one ``Engine`` over one ``ModelRunner``:

* single-stream decode tokens/s (1 sequence);
* aggregate decode tokens/s at each concurrency (default 1, 8, 32, 64 sequences,
  prompt 128 tokens, output 128 tokens, ``ignore_eos``): generated tokens of
  decode-only steps / wall time of those steps;
* prefill tokens/s and TTFT of a 2,000-token prompt, cold (no prefix-cache hit; after one
  warm-up prompt of the same length under another salt), then again with its prefix cached
  (same cache salt);
* engine overhead per step (schedule + batch building + sampling + outputs,
  i.e. step time minus ``ModelRunner.execute``), milliseconds;
* structured output (``--grammar-seqs``, default 32): aggregate decode with half of the sequences
  constrained by a JSON schema (``GRAMMAR_SCHEMA``, long enough never to complete within the output), next
  to the same run unconstrained; the grammar mask time per step (p50/p99) and the cold compile time of
  the 12 schemas in ``tests/data/structured_schemas.json`` (p50/p99).

Floors checked (ratios inside one run, so machine load cancels out):
aggregate decode at 32 sequences >= 8x single-stream; cached TTFT <= 0.1x cold; half-constrained
aggregate decode >= 0.9x unconstrained.

Usage::

    python bench/engine.py [--dtype bfloat16|float32|float16] [--device cpu|cuda]
        [--concurrency 1,8,32,64] [--prompt-len 128] [--output-len 128]
        [--long-prompt 2000] [--grammar-seqs 32] [--threads N] [--no-append]

Prints a table and appends the run to docs/perf.md (date, machine, command, numbers).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backend.engine import Engine  # noqa: E402
from backend.model_path import DEFAULT_DTYPE, default_model_path  # noqa: E402
from backend.model_runner import ModelRunner  # noqa: E402
from backend.protocol import Grammar, SamplingParams, Submit, grammar_key  # noqa: E402

# A schema the output keeps following for the whole run (64 items needed): realistic masks (keys, enums,
# integers, bounded strings) on every step.
GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
                    "tag": {"enum": ["todo", "done", "later"]},
                    "text": {"type": "string", "maxLength": 40},
                },
                "required": ["id", "tag", "text"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["notes"],
    "additionalProperties": False,
}


def rand_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # ordinary-text id range of SmolLM2 (avoid control tokens)
    return [rng.randrange(200, min(vocab, 40000)) for _ in range(n)]


def decode_run(
    engine: Engine,
    n: int,
    prompt_len: int,
    output_len: int,
    rng: random.Random,
    tag: str,
    grammar: Grammar | None = None,
    constrained: int = 0,
) -> dict:
    """Run ``n`` concurrent requests (the first ``constrained`` under ``grammar``); time decode-only steps."""
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(n):
        err = engine.add_request(
            Submit(
                request_id=f"{tag}-{i}",
                prompt_ids=rand_prompt(rng, prompt_len, engine.vocab_size),
                sampling=sp,
                cache_salt=tag,
                grammar=grammar if i < constrained else None,
            )
        )
        assert err is None, err
    while engine.compiling:  # start timing once every grammar is ready
        engine.step()
    dec_tokens = 0
    dec_time = 0.0
    steps = 0
    ovh0 = engine.step_overhead_s
    st0 = engine.num_steps
    t_all = time.perf_counter()
    while engine.has_work():
        decode_only = (
            all(s.num_uncomputed == 1 for s in engine.scheduler.running) and not engine.scheduler.waiting
        )
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if decode_only:
            dec_tokens += sum(len(m.new_token_ids) for _, m in outs)
            dec_time += dt
            steps += 1
    total = time.perf_counter() - t_all
    nsteps = max(1, engine.num_steps - st0)
    return {
        "seqs": n,
        "decode_tok_s": dec_tokens / dec_time if dec_time else 0.0,
        "decode_steps": steps,
        "total_s": total,
        "overhead_ms": 1000 * (engine.step_overhead_s - ovh0) / nsteps,
    }


def ttft(engine: Engine, prompt: list[int], salt: str, rid: str) -> tuple[float, int]:
    """Seconds from submit to the first token, and cached prompt tokens."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    assert engine.add_request(Submit(request_id=rid, prompt_ids=prompt, sampling=sp, cache_salt=salt)) is None
    cached = 0
    first = None
    while engine.has_work():
        for _, m in engine.step():
            if first is None and m.request_id == rid:
                first = time.perf_counter() - t
            if m.finish_reason is not None and m.usage is not None:
                cached = m.usage.cached_tokens
    return first or 0.0, cached


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def grammar_runs(engine: Engine, args: argparse.Namespace, rng: random.Random) -> dict:
    """The structured-output rows: unconstrained vs half-constrained decode, mask and compile times."""
    import json

    src = json.dumps(GRAMMAR_SCHEMA)
    grammar = Grammar(kind="json_schema", source=src, key=grammar_key("json_schema", src))
    n = args.grammar_seqs
    decode_run(engine, 2, 32, 8, rng, "gwarm", grammar, 1)  # builds the vocabulary and compiles once
    if engine.masks is not None:
        engine.masks.mask_time_s.clear()
    plain = decode_run(engine, n, args.prompt_len, args.output_len, rng, "gplain")
    mixed = decode_run(engine, n, args.prompt_len, args.output_len, rng, "gmixed", grammar, n // 2)
    masks = engine.masks.mask_time_s if engine.masks is not None else []
    schemas = json.loads((ROOT / "tests" / "data" / "structured_schemas.json").read_text())
    compiler = engine._compiler()  # its vocabulary is built; the 12 schemas are not in its cache yet
    times = []
    for item in schemas:
        text = json.dumps(item["schema"])
        t = time.perf_counter()
        compiler.compile(Grammar(kind="json_schema", source=text, key=grammar_key("json_schema", text)))
        times.append(time.perf_counter() - t)
    print(
        f"  grammar: {plain['decode_tok_s']:.1f} plain vs {mixed['decode_tok_s']:.1f} half-constrained tok/s",
        file=sys.stderr,
        flush=True,
    )
    return {
        "plain": plain["decode_tok_s"],
        "mixed": mixed["decode_tok_s"],
        "mask_p50": _pct(masks, 0.5),
        "mask_p99": _pct(masks, 0.99),
        "compile_p50": _pct(times, 0.5),
        "compile_p99": _pct(times, 0.99),
        "schemas": len(times),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=DEFAULT_DTYPE, choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=2000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--grammar-seqs", type=int, default=32, help="0: skip the structured-output run")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-append", action="store_true", help="do not append to docs/perf.md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    conc = [int(x) for x in args.concurrency.split(",") if x]
    max_seqs = max(conc + [1])
    bs = 16
    blocks = max_seqs * -(-(args.prompt_len + args.output_len) // bs) + 2 * -(-args.long_prompt // bs) + 64
    t0 = time.perf_counter()
    runner = ModelRunner(
        args.model or default_model_path(),
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        block_size=bs,
        num_kv_blocks=blocks,
    )
    load_s = time.perf_counter() - t0
    engine = Engine(
        runner,
        max_num_seqs=max(64, max_seqs),
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_seqs),
    )
    rng = random.Random(0)
    # warm-up
    decode_run(engine, 2, 32, 4, rng, "warm")

    rows = []
    for n in conc:
        r = decode_run(engine, n, args.prompt_len, args.output_len, rng, f"c{n}")
        rows.append(r)
        print(
            f"  {n:>3} seqs: {r['decode_tok_s']:8.1f} decode tok/s  overhead {r['overhead_ms']:.2f} ms/step",
            file=sys.stderr,
            flush=True,
        )
    single = next((r["decode_tok_s"] for r in rows if r["seqs"] == 1), None)
    gram = grammar_runs(engine, args, rng) if args.grammar_seqs > 0 else None

    # warm the long-prefill code path once (oneDNN primitives for the chunk shapes, allocator growth) with
    # another prompt under another cache salt: "cold" below means no prefix-cache hit, not a cold process
    ttft(engine, rand_prompt(rng, args.long_prompt, engine.vocab_size), "bench-warmup", "warmup-long")
    long_prompt = rand_prompt(rng, args.long_prompt, engine.vocab_size)
    cold, _ = ttft(engine, long_prompt, "bench-long", "cold")
    warm, cached = ttft(engine, long_prompt, "bench-long", "cached")
    prefill_tok_s = args.long_prompt / cold if cold else 0.0

    lines = []
    lines.append("| metric | value |")
    lines.append("|---|---|")
    for r in rows:
        lines.append(
            f"| aggregate decode tok/s, {r['seqs']} seqs (prompt {args.prompt_len}, output {args.output_len}) | {r['decode_tok_s']:.1f} |"
        )
    for r in rows:
        lines.append(f"| engine overhead per step, {r['seqs']} seqs (ms) | {r['overhead_ms']:.2f} |")
    lines.append(f"| prefill tok/s ({args.long_prompt}-token prompt, cold) | {prefill_tok_s:.1f} |")
    lines.append(f"| TTFT cold ({args.long_prompt} tokens) | {cold * 1000:.0f} ms |")
    lines.append(f"| TTFT prefix cached ({cached} tokens from cache) | {warm * 1000:.0f} ms |")
    floors = []
    if gram is not None:
        g = args.grammar_seqs
        lines.append(f"| aggregate decode tok/s, {g} seqs unconstrained (same run) | {gram['plain']:.1f} |")
        lines.append(
            f"| aggregate decode tok/s, {g} seqs, {g // 2} JSON-schema constrained | {gram['mixed']:.1f} |"
        )
        lines.append(
            f"| grammar mask time per step, {g // 2} constrained rows: p50 / p99 (ms) | "
            f"{gram['mask_p50'] * 1000:.2f} / {gram['mask_p99'] * 1000:.2f} |"
        )
        lines.append(
            f"| grammar compile, {gram['schemas']} schemas cold: p50 / p99 (ms) | "
            f"{gram['compile_p50'] * 1000:.1f} / {gram['compile_p99'] * 1000:.1f} |"
        )
        ratio = gram["mixed"] / gram["plain"] if gram["plain"] else 0.0
        floors.append(
            f"half-constrained / unconstrained decode = {ratio:.2f} (floor 0.9: {'PASS' if ratio >= 0.9 else 'FAIL'})"
        )
    r32 = next((r["decode_tok_s"] for r in rows if r["seqs"] == 32), None)
    if single and r32:
        ratio = r32 / single
        floors.append(f"aggregate@32 / single = {ratio:.1f}x (floor 8x: {'PASS' if ratio >= 8 else 'FAIL'})")
    if cold:
        ratio = warm / cold
        floors.append(f"cached TTFT / cold = {ratio:.3f} (floor 0.1: {'PASS' if ratio <= 0.1 else 'FAIL'})")
    table = "\n".join(lines)
    print(table)
    for f in floors:
        print(f)

    if not args.no_append:
        machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, threads {torch.get_num_threads()}"
        if args.device.startswith("cuda") and torch.cuda.is_available():
            machine += f", {torch.cuda.get_device_name()}"
        try:
            load = os.getloadavg()[0]
            machine += f", load avg {load:.1f} at start of write"
        except OSError:
            pass
        cmd = "python bench/engine.py " + " ".join(sys.argv[1:])
        entry = (
            f"\n## engine bench {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}\n\n"
            f"- machine: {machine}\n- command: `{cmd}`\n- model: {runner.card.name} ({runner.card.quantization}) "
            f"dtype {runner.card.dtype} device {runner.card.device}, attention {runner.card.attention_backend}, "
            f"C++ CPU kernels {'on' if getattr(runner.model, 'cpu_kernels', None) is not None else 'off'}, load {load_s:.1f} s\n\n"
            + table
            + "\n\n"
            + "\n".join(f"- {f}" for f in floors)
            + "\n"
        )
        perf = ROOT / "docs" / "perf.md"
        if not perf.exists():
            perf.write_text("# Performance log\n\nAppend-only: date, machine, command, numbers.\n")
        with perf.open("a") as fh:
            fh.write(entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
