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

``--speculative`` (instead of the runs above): n-gram speculative decoding off (K=0) vs on
(``--num-speculative-tokens`` K, default the backend's) in one run over one model load. For each prompt set of
``bench/spec_prompts.py`` (``grounded``: quote, summarize, edit or extract from a given text, whose answer
reuses spans of the prompt; ``open``: open-ended chat), rendered by the model's own chat template, each
prompt runs alone, greedy (and with ``--spec-sampled`` also temperature 0.8 with a fixed seed), first with
speculation off, then on; the token ids must be identical (a loud ``MISMATCH`` otherwise, exit status 1).
Single-stream tok/s off / on (output tokens after the first over the time from the first token to the
end), the ratio, tokens per step, and the acceptance (accepted / drafted draft tokens, and per position:
accepted at position j / verify chunks, from ``Engine.stats()``). Then ``--spec-streams`` (default 32)
concurrent streams of both sets interleaved, off then on: aggregate tok/s (all output tokens / wall time)
and the ratio. ``--off-mode request`` makes "off" the engine at K with every request opting out
(``SamplingParams.speculative`` false, what the gateway's ``"speculative": false`` sends) instead of K=0.

Floors checked (ratios inside one run, so machine load cancels out):
aggregate decode at 32 sequences >= 8x single-stream; cached TTFT <= 0.1x cold; half-constrained
aggregate decode >= 0.9x unconstrained.

Usage::

    python bench/engine.py [--dtype bfloat16|float32|float16] [--device cpu|cuda]
        [--concurrency 1,8,32,64] [--prompt-len 128] [--output-len 128]
        [--long-prompt 2000] [--grammar-seqs 32] [--threads N] [--no-append]
    python bench/engine.py --speculative [--num-speculative-tokens 5] [--speculative-max-batch 4]
        [--prompt-lookup-min 1] [--prompt-lookup-max 8] [--output-len 128] [--spec-prompts N]
        [--spec-streams 32] [--spec-sampled] [--ignore-eos] [--off-mode engine|request] [--json PATH]

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
from backend.model_path import WEIGHTS, default_dtype, default_model_path, generated_int4, prompt_int4  # noqa: E402
from backend.model_runner import ModelRunner  # noqa: E402
from backend.proposer import (  # noqa: E402
    DRAFT_TOKENS_DENSE,
    DRAFT_TOKENS_INT4,
    PROMPT_LOOKUP_MAX,
    PROMPT_LOOKUP_MIN,
    default_draft_tokens,
)
from backend.protocol import Grammar, RequestError, SamplingParams, Submit, grammar_key  # noqa: E402

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


def _append_perf(
    runner: ModelRunner, load_s: float, table: str, floors: list[str], title: str = "engine bench"
) -> None:
    """Append a run to docs/perf.md: date, machine, command, model, the table and the floor lines."""
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, threads {torch.get_num_threads()}"
    if str(runner.card.device).startswith("cuda") and torch.cuda.is_available():
        machine += f", {torch.cuda.get_device_name()}"
    try:
        load = os.getloadavg()[0]
        machine += f", load avg {load:.1f} at start of write"
    except OSError:
        pass
    cmd = "python bench/engine.py " + " ".join(sys.argv[1:])
    entry = (
        f"\n## {title} {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}\n\n"
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


# ---------------------------------------------------------------------- --speculative: K=0 vs K=n


def _spec_counters(engine: Engine) -> tuple[int, int, int, list[int]]:
    st = engine.stats()
    return st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens, list(st.spec_accepted_per_pos)


def _spec_delta(before: tuple, after: tuple) -> dict:
    """Speculation counters between two ``_spec_counters`` snapshots: totals, rates, per position."""
    drafts = after[0] - before[0]
    drafted = after[1] - before[1]
    accepted = after[2] - before[2]
    per_pos = [a - (before[3][j] if j < len(before[3]) else 0) for j, a in enumerate(after[3])]
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_per_draft": accepted / drafts if drafts else None,
        "accepted_per_pos": per_pos,
        # vLLM's per-position acceptance rate: accepted at position j / verify chunks (drafts shorter than
        # j + 1 count as not accepted there)
        "acceptance_per_pos": [a / drafts if drafts else None for a in per_pos],
    }


def _set_spec(engine: Engine, on: bool, k: int, off_mode: str) -> bool:
    """Speculation on (K=k) or off. ``off_mode`` "engine": off is the engine at K=0 (no proposer call at
    all); "request": the engine stays at K=k and each request opts out (``SamplingParams.speculative``
    False, what the gateway's ``"speculative": false`` sends). Returns the requests' ``speculative``."""
    engine.num_speculative_tokens = k if on or off_mode == "request" else 0
    return on


def _gen_one(engine: Engine, ids: list[int], sp: SamplingParams, rid: str, salt: str) -> dict:
    """One request alone: its tokens, wall time from submit, time from its first token to its end, steps."""
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    err = engine.add_request(Submit(request_id=rid, prompt_ids=ids, sampling=sp, cache_salt=salt))
    assert err is None, err
    toks: list[int] = []
    first = None
    steps_after_first = 0
    while engine.has_work():
        outs = engine.step()
        if first is not None:
            steps_after_first += 1
        for _, m in outs:
            if isinstance(m, RequestError):
                raise RuntimeError(f"{m.code}: {m.message}")
            if m.request_id == rid and m.new_token_ids:
                toks.extend(m.new_token_ids)
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    return {
        "tokens": toks,
        "e2e_s": end - t0,
        "decode_s": end - (first or end),
        "decode_steps": steps_after_first,
        "steps": engine.num_steps - steps0,
    }


def _gen_many(engine: Engine, reqs: list[tuple[list[int], SamplingParams]], tag: str) -> dict:
    """All ``reqs`` at once (each under its own cache salt): tokens per request, wall time, decode-only
    steps' tokens and time (as ``decode_run``)."""
    for i, (ids, sp) in enumerate(reqs):
        err = engine.add_request(
            Submit(request_id=f"{tag}-{i}", prompt_ids=ids, sampling=sp, cache_salt=f"{tag}-{i}")
        )
        assert err is None, err
    toks: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(reqs))}
    dec_tokens, dec_time = 0, 0.0
    t_all = time.perf_counter()
    while engine.has_work():
        decode_only = (
            all(s.num_uncomputed == 1 for s in engine.scheduler.running) and not engine.scheduler.waiting
        )
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        n = 0
        for _, m in outs:
            if isinstance(m, RequestError):
                raise RuntimeError(f"{m.code}: {m.message}")
            toks[m.request_id].extend(m.new_token_ids)
            n += len(m.new_token_ids)
        if decode_only:
            dec_tokens += n
            dec_time += dt
    wall = time.perf_counter() - t_all
    total = sum(len(t) for t in toks.values())
    return {
        "tokens": [toks[f"{tag}-{i}"] for i in range(len(reqs))],
        "total_tokens": total,
        "wall_s": wall,
        "tok_s": total / wall if wall else 0.0,
        "decode_tok_s": dec_tokens / dec_time if dec_time else 0.0,
    }


def _chat_prompts(model_path: str) -> dict[str, list[tuple[str, list[int]]]]:
    """``bench/spec_prompts.py``'s sets rendered and tokenized by the model's chat template (as the
    gateway does: ``templating.ChatTemplate.render``)."""
    from bench.spec_prompts import SETS
    from templating import ChatTemplate, cached_tokenizer

    template = ChatTemplate(cached_tokenizer(model_path))
    return {s: [(name, template.render(msgs).ids) for name, msgs in items] for s, items in SETS.items()}


def _tok_s(tokens: float, secs: float) -> float:
    return tokens / secs if secs else 0.0


def speculative_bench(runner: ModelRunner, args: argparse.Namespace, load_s: float) -> int:
    """``--speculative``: each prompt alone with speculation off then on (token ids compared), per set;
    then ``--spec-streams`` concurrent streams of both sets, off then on. Prints a table; 1 on a mismatch."""
    if args.num_speculative_tokens is None:
        args.num_speculative_tokens = default_draft_tokens(runner.generated_int4)
    k = args.num_speculative_tokens
    if k <= 0:
        print("error: --speculative needs --num-speculative-tokens > 0", file=sys.stderr)
        return 2
    sets = _chat_prompts(runner.card.model_path or args.model or default_model_path())
    if args.spec_prompts:
        sets = {s: items[: args.spec_prompts] for s, items in sets.items()}
    n_streams = args.spec_streams
    engine = Engine(
        runner,
        max_num_seqs=max(64, n_streams),
        max_num_batched_tokens=max(args.max_num_batched_tokens, n_streams),
        num_speculative_tokens=k,
        speculative_max_batch=args.speculative_max_batch,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
    )
    out_len = args.output_len
    samplings = [("greedy", None)] + ([("T=0.8 seeded", 0.8)] if args.spec_sampled else [])

    def params(temp: float | None, seed: int, spec: bool, max_tokens: int = out_len) -> SamplingParams:
        if temp is None:
            return SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=args.ignore_eos, speculative=spec
            )
        return SamplingParams(
            temperature=temp, seed=seed, max_tokens=max_tokens, ignore_eos=args.ignore_eos, speculative=spec
        )

    # warm-up: both paths' shapes (verify chunks of up to k + 1 rows) once, under their own salts
    warm_ids = next(iter(sets.values()))[0][1]
    for on in (False, True):
        spec = _set_spec(engine, on, k, args.off_mode)
        _gen_one(engine, warm_ids, params(None, 0, spec, 24), f"spec-warm-{on}", f"spec-warm-{on}")

    rows: list[dict] = []
    mismatches: list[str] = []
    for set_name, items in sets.items():
        for label, temp in samplings:
            acc = {
                "off": [0, 0.0, 0.0, 0, 0],
                "on": [0, 0.0, 0.0, 0, 0],
            }  # tokens, decode s, e2e s, dec steps, n
            c0 = c1 = None
            per_prompt = []
            for j, (pname, ids) in enumerate(items):
                got = {}
                for mode in ("off", "on"):
                    spec = _set_spec(engine, mode == "on", k, args.off_mode)
                    if mode == "on":
                        before = _spec_counters(engine)
                    tag = f"spec-{set_name}-{label}-{j}-{mode}"
                    r = _gen_one(engine, ids, params(temp, 1000 + j, spec), tag, tag)
                    if mode == "on":
                        after = _spec_counters(engine)
                        c0 = before if c0 is None else c0
                        c1 = after
                        r["spec"] = _spec_delta(before, after)
                    got[mode] = r
                    a = acc[mode]
                    a[0] += max(0, len(r["tokens"]) - 1)
                    a[1] += r["decode_s"]
                    a[2] += r["e2e_s"]
                    a[3] += r["decode_steps"]
                    a[4] += len(r["tokens"])
                same = got["off"]["tokens"] == got["on"]["tokens"]
                if not same:
                    n = next(
                        (
                            i
                            for i, (x, y) in enumerate(zip(got["off"]["tokens"], got["on"]["tokens"]))
                            if x != y
                        ),
                        min(len(got["off"]["tokens"]), len(got["on"]["tokens"])),
                    )
                    msg = (
                        f"MISMATCH: {set_name}/{pname} ({label}): token ids differ with speculation on "
                        f"(first difference at output position {n}; {len(got['off']['tokens'])} vs "
                        f"{len(got['on']['tokens'])} tokens)"
                    )
                    mismatches.append(msg)
                    print("!!! " + msg, file=sys.stderr, flush=True)
                off_r = _tok_s(max(0, len(got["off"]["tokens"]) - 1), got["off"]["decode_s"])
                on_r = _tok_s(max(0, len(got["on"]["tokens"]) - 1), got["on"]["decode_s"])
                sp = got["on"]["spec"]
                per_prompt.append(
                    {
                        "prompt": pname,
                        "prompt_tokens": len(ids),
                        "tokens": len(got["on"]["tokens"]),
                        "identical": same,
                        "off_tok_s": off_r,
                        "on_tok_s": on_r,
                        "accepted": sp["accepted_tokens"],
                        "drafted": sp["draft_tokens"],
                    }
                )
                rate = f"{sp['acceptance_rate']:.2f}" if sp["acceptance_rate"] is not None else "-"
                print(
                    f"  {set_name:8s} {label:12s} {pname:14s} {len(ids):4d} prompt / {len(got['on']['tokens']):4d} out tokens: "
                    f"{off_r:7.1f} off / {on_r:7.1f} on tok/s, accepted {sp['accepted_tokens']}/{sp['draft_tokens']} "
                    f"({rate}){'' if same else '  MISMATCH'}",
                    file=sys.stderr,
                    flush=True,
                )
            off_tok_s = _tok_s(acc["off"][0], acc["off"][1])
            on_tok_s = _tok_s(acc["on"][0], acc["on"][1])
            rows.append(
                {
                    "set": set_name,
                    "sampling": label,
                    "prompts": len(items),
                    "output_tokens": acc["on"][4],
                    "off_tok_s": off_tok_s,
                    "on_tok_s": on_tok_s,
                    "ratio": on_tok_s / off_tok_s if off_tok_s else None,
                    "off_e2e_tok_s": _tok_s(acc["off"][4], acc["off"][2]),
                    "on_e2e_tok_s": _tok_s(acc["on"][4], acc["on"][2]),
                    "off_tok_per_step": acc["off"][0] / acc["off"][3] if acc["off"][3] else None,
                    "on_tok_per_step": acc["on"][0] / acc["on"][3] if acc["on"][3] else None,
                    "identical": all(p["identical"] for p in per_prompt),
                    "spec": _spec_delta(c0, c1) if c0 is not None else None,
                    "per_prompt": per_prompt,
                }
            )

    # N concurrent streams, both sets interleaved, greedy
    conc = None
    if n_streams > 0:
        from bench.spec_prompts import interleaved

        by_name = {(s, name): ids for s, items in sets.items() for name, ids in items}
        picks = [p for p in interleaved(10_000) if (p[0], p[1]) in by_name][:n_streams]
        got = {}
        for mode in ("off", "on"):
            spec = _set_spec(engine, mode == "on", k, args.off_mode)
            before = _spec_counters(engine)
            reqs = [(by_name[(s, name)], params(None, 0, spec)) for s, name, _ in picks]
            got[mode] = _gen_many(engine, reqs, f"spec-streams-{mode}")
            got[mode]["spec"] = _spec_delta(before, _spec_counters(engine))
            print(
                f"  {n_streams} streams {mode}: {got[mode]['tok_s']:.1f} tok/s ({got[mode]['total_tokens']} tokens "
                f"in {got[mode]['wall_s']:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        diff = [i for i, (a, b) in enumerate(zip(got["off"]["tokens"], got["on"]["tokens"])) if a != b]
        if diff:
            msg = f"MISMATCH: {len(diff)} of {n_streams} concurrent streams differ with speculation on (requests {diff[:8]})"
            mismatches.append(msg)
            print("!!! " + msg, file=sys.stderr, flush=True)
        conc = {
            "streams": n_streams,
            "off_tok_s": got["off"]["tok_s"],
            "on_tok_s": got["on"]["tok_s"],
            "ratio": got["on"]["tok_s"] / got["off"]["tok_s"] if got["off"]["tok_s"] else None,
            "off_decode_tok_s": got["off"]["decode_tok_s"],
            "on_decode_tok_s": got["on"]["decode_tok_s"],
            "output_tokens": got["on"]["total_tokens"],
            "identical": not diff,
            "spec": got["on"]["spec"],
        }

    def f(x, fmt=".1f"):
        return "-" if x is None else format(x, fmt)

    def pos(sp):
        return " ".join(f(x, ".2f") for x in sp["acceptance_per_pos"]) if sp and sp["drafts"] else "-"

    lines = [
        f"speculation: K={k} draft tokens, at most {args.speculative_max_batch} decoding sequences, n-grams "
        f"{args.prompt_lookup_min}-{args.prompt_lookup_max}; off = "
        + ("K=0" if args.off_mode == "engine" else "speculative: false per request")
        + f"; max_tokens {out_len}{', ignore_eos' if args.ignore_eos else ''}",
        "",
        "| set | sampling | prompts | out tokens | off tok/s | on tok/s | on / off | tok/step on | "
        "accepted / drafted | acceptance | per position | same ids |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = r["spec"]
        lines.append(
            f"| {r['set']} | {r['sampling']} | {r['prompts']} | {r['output_tokens']} | {f(r['off_tok_s'])} | "
            f"{f(r['on_tok_s'])} | {f(r['ratio'], '.2f')}x | {f(r['on_tok_per_step'], '.2f')} | "
            f"{sp['accepted_tokens']} / {sp['draft_tokens']} | {f(sp['acceptance_rate'], '.2f')} | {pos(sp)} | "
            f"{'yes' if r['identical'] else 'MISMATCH'} |"
        )
    if conc is not None:
        sp = conc["spec"]
        lines.append(
            f"| {conc['streams']} streams, both sets | greedy | {conc['streams']} | {conc['output_tokens']} | "
            f"{f(conc['off_tok_s'])} | {f(conc['on_tok_s'])} | {f(conc['ratio'], '.2f')}x | - | "
            f"{sp['accepted_tokens']} / {sp['draft_tokens']} | {f(sp['acceptance_rate'], '.2f')} | {pos(sp)} | "
            f"{'yes' if conc['identical'] else 'MISMATCH'} |"
        )
    notes = [
        "tok/s single-stream: output tokens after the first / time from the first token to the end, summed "
        "over the set's prompts (each prompt alone); streams: all output tokens / wall time of the run",
        "acceptance: accepted / drafted draft tokens; per position j: verify chunks whose draft token j was "
        "accepted / verify chunks (vLLM's per-position rate)",
    ]
    table = "\n".join(lines)
    print(table)
    print()
    for n in notes:
        print(f"- {n}")
    for m in mismatches:
        print(f"!!! {m}")

    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump(
                {"config": vars(args), "sets": rows, "streams": conc, "mismatches": mismatches}, fh, indent=2
            )
    if not args.no_append:
        _append_perf(
            runner, load_s, table, notes + mismatches, "engine bench, speculative decoding off vs on"
        )
    return 1 if mismatches else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32", "float16"],
        help="default: the backend's for --device",
    )
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--weights", default="auto", choices=list(WEIGHTS), help="as the backend's --weights")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=2000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--grammar-seqs", type=int, default=32, help="0: skip the structured-output run")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-append", action="store_true", help="do not append to docs/perf.md")
    sp = ap.add_argument_group("speculative decoding (--speculative)")
    sp.add_argument(
        "--speculative",
        action="store_true",
        help="compare speculation off (K=0) and on (K=--num-speculative-tokens), single-stream and at "
        "--spec-streams, on the grounded and open prompt sets (instead of the runs above)",
    )
    from backend.__main__ import SPEC_MAX_BATCH

    sp.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="K of the 'on' runs (default the backend's for the runner: backend.proposer.default_draft_tokens)",
    )
    sp.add_argument(
        "--speculative-max-batch",
        type=int,
        default=SPEC_MAX_BATCH,
        help=f"as the backend's flag (default {SPEC_MAX_BATCH})",
    )
    sp.add_argument("--prompt-lookup-min", type=int, default=PROMPT_LOOKUP_MIN)
    sp.add_argument("--prompt-lookup-max", type=int, default=PROMPT_LOOKUP_MAX)
    sp.add_argument(
        "--spec-prompts", type=int, default=0, help="only the first N prompts of each set (0: all)"
    )
    sp.add_argument("--spec-streams", type=int, default=32, help="concurrent streams, off vs on (0: skip)")
    sp.add_argument("--spec-sampled", action="store_true", help="also temperature 0.8, seeded, off vs on")
    sp.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    sp.add_argument(
        "--off-mode",
        default="engine",
        choices=["engine", "request"],
        help="'off' as the engine at K=0 (default) or each request with speculative=false",
    )
    sp.add_argument("--json", default=None, help="write the --speculative results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    conc = [int(x) for x in args.concurrency.split(",") if x]
    max_seqs = max(conc + [1])
    bs = 16
    blocks = max_seqs * -(-(args.prompt_len + args.output_len) // bs) + 2 * -(-args.long_prompt // bs) + 64
    if args.speculative:
        from bench.spec_prompts import GROUNDED, OPEN
        from templating import ChatTemplate, cached_tokenizer

        template = ChatTemplate(cached_tokenizer(args.model or default_model_path()))
        longest = max(len(template.render(m).ids) for _, m in GROUNDED + OPEN)
        k_max = args.num_speculative_tokens or max(DRAFT_TOKENS_DENSE, DRAFT_TOKENS_INT4)
        per_seq = -(-(longest + args.output_len + k_max + 1) // bs)
        blocks = max(1, args.spec_streams) * per_seq + 64
    t0 = time.perf_counter()
    runner = ModelRunner(
        args.model or default_model_path(),
        device=args.device,
        dtype=args.dtype or default_dtype(args.device),
        attention_backend=args.attention_backend,
        block_size=bs,
        num_kv_blocks=blocks,
        generated_int4=generated_int4(args.weights, args.device),
        prompt_int4=prompt_int4(args.weights),
    )
    load_s = time.perf_counter() - t0
    if args.speculative:
        return speculative_bench(runner, args, load_s)
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
        _append_perf(runner, load_s, table, floors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
