"""Replay recorded greedy answers through n-gram draft proposers: tokens per step without the model.

Greedy speculative decoding is lossless, so the answer with speculation on is the recorded one, and every
verify step's outcome is fixed by the proposer alone: the draft's longest prefix that equals the recorded
continuation is accepted, plus the model's own next token. That makes proposer variants comparable in
milliseconds, on the same text, where ``bench/engine.py --speculative`` takes minutes per variant and
its tok/s moves with the machine.

    python bench/spec_replay.py --record /tmp/answers.json [--dtype float32] [--output-len 128]
    python bench/spec_replay.py --replay /tmp/answers.json [--k 3 5 8] [--verify-cost 1.3]

``--record`` runs ``bench/spec_prompts.py``'s sets greedy, speculation off, through the real ``Engine``
and writes ``{set: [{"name", "prompt_ids", "output_ids"}]}``. ``--replay`` simulates the engine's loop per
answer (``backend.engine.Engine._propose`` / ``_verify``: a draft of at most ``min(K, max_tokens -
generated - 1)`` tokens from ``backend.proposer.DraftPolicy`` over prompt + output so far, its back-off
fed with each outcome) and prints, per proposer and set, tokens per step, the acceptance rate, the share
of steps that verified a draft, and the speed-up a verify step of ``--verify-cost`` times a decode step
would give (steps without a draft cost 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.proposer import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN, DraftPolicy  # noqa: E402

Proposer = Callable[[int], DraftPolicy]


def replay(answers: list[dict], make: Proposer, k: int, max_tokens: int) -> dict:
    """Simulate speculative decoding of ``answers`` with ``make(k)`` as each sequence's policy.

    Returns tokens (answer tokens after the first, which prefill samples), steps (decode steps), verify
    steps, drafted and accepted tokens, and ``by_len``: verify steps per draft length."""
    tot = {"tokens": 0, "steps": 0, "verify_steps": 0, "drafted": 0, "accepted": 0, "by_len": {}}
    for a in answers:
        prompt, out = a["prompt_ids"], a["output_ids"]
        policy = make(k)
        i = 1  # the first token comes from the prompt's last row (prefill), never drafted for
        while i < len(out):
            ctx = prompt + out[:i]
            limit = max_tokens - i - 1
            draft = policy.propose(ctx, limit) if limit > 0 else []
            matched = 0
            for d, t in zip(draft, out[i:]):
                if d != t:
                    break
                matched += 1
            if draft:
                policy.record(len(draft), matched)
                tot["verify_steps"] += 1
                tot["drafted"] += len(draft)
                tot["accepted"] += matched
                tot["by_len"][len(draft)] = tot["by_len"].get(len(draft), 0) + 1
            step = min(matched + 1, len(out) - i)
            i += step
            tot["steps"] += 1
        tot["tokens"] += len(out) - 1
    return tot


def record(args: argparse.Namespace) -> int:
    """Greedy answers of both prompt sets, speculation off, written to ``args.record``."""
    from backend.engine import Engine, collect_tokens
    from backend.model_path import default_dtype, default_model_path, generated_int4, prompt_int4
    from backend.model_runner import ModelRunner
    from backend.protocol import SamplingParams, Submit
    from bench.spec_prompts import SETS
    from templating import ChatTemplate, cached_tokenizer

    path = args.model or default_model_path()
    runner = ModelRunner(
        path,
        dtype=args.dtype or default_dtype(),
        num_threads=args.threads,
        generated_int4=generated_int4(args.weights, "cpu"),
        prompt_int4=prompt_int4(args.weights),
    )
    template = ChatTemplate(cached_tokenizer(path))
    engine = Engine(runner)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, speculative=False)
    data: dict[str, list[dict]] = {}
    for set_name, items in SETS.items():
        data[set_name] = []
        for j, (name, msgs) in enumerate(items):
            ids = template.render(msgs).ids
            rid = f"{set_name}-{j}"
            res = engine.generate([Submit(request_id=rid, prompt_ids=ids, sampling=params)])
            data[set_name].append({"name": name, "prompt_ids": ids, "output_ids": collect_tokens(res[rid])})
            print(
                f"{set_name} {name}: {len(ids)} prompt / {len(data[set_name][-1]['output_ids'])} out",
                file=sys.stderr,
            )
    meta = {
        "dtype": runner.card.dtype,
        "weights": runner.card.weights,
        "output_len": args.output_len,
        "model": path,
    }
    Path(args.record).write_text(json.dumps({"meta": meta, "sets": data}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", help="write greedy answers (speculation off) to this JSON file")
    ap.add_argument("--replay", help="replay the answers of this JSON file through the proposers")
    ap.add_argument("--model")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--weights", default="auto", help="as the backend's --weights (default auto)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 4, 5, 8], help="draft lengths to replay")
    ngrams = f"{PROMPT_LOOKUP_MIN}-{PROMPT_LOOKUP_MAX}"
    ap.add_argument(
        "--ngrams", default=ngrams, help=f"n-gram lengths min-max (default {ngrams}, the backend's)"
    )
    ap.add_argument("--verify-cost", type=float, default=1.3, help="a verify step's cost in decode steps")
    ap.add_argument(
        "--row-costs",
        default=None,
        help="comma-separated cost of a step of 1, 2, ... rows in 1-row steps (measured, e.g. with "
        "bench/model_step.py): a verify step of a d-token draft costs entry d+1 (the last entry past the "
        "list); instead of --verify-cost",
    )
    args = ap.parse_args(argv)
    if args.record:
        return record(args)
    if not args.replay:
        ap.error("--record or --replay")
    doc = json.loads(Path(args.replay).read_text())
    lo, hi = (int(x) for x in args.ngrams.split("-"))
    max_tokens = doc["meta"]["output_len"]
    print(
        f"answers: {doc['meta']['dtype']} {doc['meta'].get('weights', '')}, max_tokens {max_tokens}; n-grams "
        f"{lo}-{hi}; verify step = "
        + (f"row costs {args.row_costs}" if args.row_costs else f"{args.verify_cost} decode steps")
    )
    row_costs = [float(x) for x in args.row_costs.split(",")] if args.row_costs else None
    print("| K | set | tokens/step | acceptance | steps with a draft | est. speed-up |")
    print("|---|---|---|---|---|---|")
    for k in args.k:
        for set_name, answers in doc["sets"].items():
            t = replay(answers, lambda kk: DraftPolicy(kk, lo, hi), k, max_tokens)
            if row_costs:
                verify = sum(n * row_costs[min(d, len(row_costs) - 1)] for d, n in t["by_len"].items())
                cost = t["steps"] - t["verify_steps"] + verify
            else:
                cost = t["steps"] + t["verify_steps"] * (args.verify_cost - 1.0)
            print(
                f"| {k} | {set_name} | {t['tokens'] / t['steps']:.2f} | "
                f"{t['accepted'] / max(1, t['drafted']):.2f} | {t['verify_steps'] / t['steps']:.2f} | "
                f"{t['tokens'] / cost:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
