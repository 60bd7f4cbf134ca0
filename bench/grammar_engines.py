"""llguidance vs xgrammar as the structured-output grammar engine, on the default model's vocabulary.

For each engine, in its own process (xgrammar lives in a separate venv: it is not a project dependency):

* tokenizer build: llguidance ``LLTokenizer`` from the tokenizer.json text; xgrammar ``TokenizerInfo``
  (BYTE_LEVEL, from the raw vocabulary) plus its ``GrammarCompiler``;
* compile, cold (xgrammar's cache disabled; llguidance has none), ``--repeats`` times for each schema of
  ``tests/data/structured_schemas.json`` and for one tool-call grammar (GBNF; llguidance gets it through its
  own ``gbnf_to_lark``): schema text -> a matcher ready for its first mask. The first mask after each
  compile is timed apart ("first mask"): llguidance builds its lexer lazily, so part of its compile
  work lands there and in the masks of the first walk (reported as the "cold" walk);
* per-step mask: ``--walks`` walks of a valid instance (written here, checked with ``jsonschema``,
  tokenized with ``encode_plain``) token by token with a fresh matcher, the mask filled before every
  token (and before the stop token), the token checked against the mask, then consumed;
* memory: RSS after the import, after the tokenizer build, after all grammars are compiled and kept;
* bad inputs (``$ref`` cycles, an unknown ``type``, a dangling ``$ref``, unsupported keywords, broken
  JSON, 100 KB and 1 MB schemas of many properties), each in its own process under ``--bad-timeout``
  seconds and ``--bad-rss-mb`` MB of RSS: what the engine says at compile/validate, at matcher build and
  at the first mask, and how long each took.

Both engines read the same token sequences, written by this script (run with the project's venv) to a
temporary workload file; the workers import nothing from the project.

Usage::

    .venv/bin/python bench/grammar_engines.py                      # both engines (xgrammar: /tmp/xgv)
    .venv/bin/python bench/grammar_engines.py --engines llguidance --no-bad
    .venv/bin/python bench/grammar_engines.py --repeats 10 --walks 3 --json /tmp/engines.json
    .venv/bin/python bench/grammar_engines.py --xgrammar-python /path/to/venv/bin/python
    .venv/bin/python bench/grammar_engines.py --bad-only --bad-cases props_1mb_required --bad-timeout 150

A venv for xgrammar (it pins torch; never install it into .venv)::

    python3 -m venv /tmp/xgv
    /tmp/xgv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    echo torch==2.13.0 > /tmp/xgv-constraints.txt
    /tmp/xgv/bin/pip install -c /tmp/xgv-constraints.txt xgrammar tokenizers numpy

Without that python (``--xgrammar-python``, ``$XGRAMMAR_PYTHON``, default ``/tmp/xgv/bin/python``) the
script says so and measures llguidance alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "tests" / "data" / "structured_schemas.json"
ENGINES = ("llguidance", "xgrammar")

# One valid instance per schema of tests/data/structured_schemas.json (checked with jsonschema).
EXAMPLES: dict[str, Any] = {
    "person": {"name": "Alice", "age": 34, "email": "alice@example.com"},
    "address": {"street": "12 Baker Street", "city": "London", "zip": "10115", "country": "UK"},
    "product": {"name": "Desk lamp", "price": 24.99, "tags": ["home", "light"]},
    "todo_list": {"todos": [{"title": "Buy milk", "done": False}, {"title": "Call mom", "done": True}]},
    "classification": {"label": "positive", "confidence": 0.92},
    "calendar_event": {"title": "Team sync", "date": "2025-03-14", "duration_minutes": 30, "all_day": False},
    "order": {
        "order_id": 1042,
        "items": [{"sku": "ABC-123", "quantity": 2}, {"sku": "XYZ-900", "quantity": 1}],
        "status": "shipped",
    },
    "weather_tool_arguments": {"city": "Paris", "unit": "celsius"},
    "book": {"title": "The Hobbit", "author": {"first": "John", "last": "Tolkien"}, "year": 1937},
    "entities": {
        "entities": [{"text": "Ada Lovelace", "kind": "person"}, {"text": "London", "kind": "place"}]
    },
    "color": {"name": "teal", "hex": "#008080", "rgb": [0, 128, 128]},
    "shopping_list": ["eggs", "bread", "apples"],
}

# A tool-call grammar in GBNF: xgrammar compiles it as EBNF, llguidance after its gbnf_to_lark.
TOOL_GBNF = r"""root ::= "<tool_call>\n" call "\n</tool_call>"
call ::= weather | search
weather ::= "{\"name\": \"get_weather\", \"arguments\": {\"city\": " str ", \"unit\": " unit "}}"
search ::= "{\"name\": \"web_search\", \"arguments\": {\"query\": " str ", \"limit\": " int "}}"
str ::= "\"" [^"\\\n]{1,30} "\""
unit ::= "\"celsius\"" | "\"fahrenheit\""
int ::= [1-9] [0-9]?
"""
TOOL_EXAMPLE = '<tool_call>\n{"name": "web_search", "arguments": {"query": "weather in Paris", "limit": 5}}\n</tool_call>'


def _many_properties(n: int | None, min_bytes: int = 0, required: bool = False) -> str:
    """An object schema of many optional (or all required) short string properties."""
    props: dict[str, Any] = {}
    i = 0
    while (n is not None and i < n) or (n is None and (i % 1000 or len(json.dumps(props)) < min_bytes)):
        props[f"property_{i:06d}_of_a_very_large_schema"] = {"type": "string", "maxLength": 16}
        i += 1
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = list(props)
    return json.dumps(schema)


def bad_inputs() -> dict[str, dict[str, str]]:
    """name -> {"text": schema text, "what": one line}."""

    def js(obj: Any) -> str:
        return json.dumps(obj)

    return {
        "ref_cycle": {
            "what": "$ref to itself: {$defs:{a:{$ref:#/$defs/a}}, $ref:#/$defs/a}",
            "text": js({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        },
        "ref_cycle_2": {
            "what": "$ref cycle a -> b -> a",
            "text": js(
                {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
            ),
        },
        "recursive_ok": {
            "what": "control: a recursive tree node (valid)",
            "text": js(
                {
                    "$defs": {
                        "node": {
                            "type": "object",
                            "properties": {
                                "v": {"type": "integer"},
                                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                            },
                            "required": ["v"],
                        }
                    },
                    "$ref": "#/$defs/node",
                }
            ),
        },
        "unknown_type": {"what": '{"type": "foo"}', "text": js({"type": "foo"})},
        "dangling_ref": {"what": "$ref to a missing $defs entry", "text": js({"$ref": "#/$defs/missing"})},
        "unique_items": {
            "what": "unsupported keyword uniqueItems",
            "text": js({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
        },
        "pattern_lookahead": {
            "what": "pattern with a lookahead (?=...)",
            "text": js({"type": "string", "pattern": "^(?=a)a+$"}),
        },
        "not_json": {"what": "truncated JSON text", "text": '{"type": "object", "properties": {'},
        "props_100kb_optional": {
            "what": "100 KB: 1,300 optional string properties",
            "text": _many_properties(1300),
        },
        "props_1mb_optional": {
            "what": "1 MB: 13,000 optional string properties",
            "text": _many_properties(None, min_bytes=1_000_000),
        },
        "props_1mb_required": {
            "what": "1.5 MB: the same 13,000 properties, all required",
            "text": _many_properties(None, min_bytes=1_000_000, required=True),
        },
    }


# ---------------------------------------------------------------------------------------------------
# Worker side: stdlib + numpy + one engine, nothing from the project
# ---------------------------------------------------------------------------------------------------


def _rss_mb(field: str = "VmRSS:") -> float:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed: the parent reads what was written even if it kills us."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _first_line(s: str, n: int = 200) -> str:
    """An engine message on one line: llguidance's ``<state>``/``<backtrace>`` dumps cut off."""
    s = (s or "").split("<state>")[0].split("<backtrace>")[0]
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


class EngineRejected(Exception):
    """The engine refused the grammar (at compile, validate or matcher build)."""


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self) -> None:
        from importlib.metadata import version

        import llguidance
        import llguidance.numpy
        import numpy as np

        self.llg, self.lnp, self.np = llguidance, llguidance.numpy, np
        self.version = version("llguidance")

    def build_tokenizer(self, w: dict[str, Any]) -> None:
        self.tok = self.llg.LLTokenizer(w["tokenizer_json"], n_vocab=w["vocab_size"], eos_token=w["stop_ids"])

    def alloc(self) -> tuple[Any, Any]:
        bm = self.lnp.allocate_token_bitmask(1, self.tok.vocab_size)
        return bm, bm

    def grammar_text(self, kind: str, text: str) -> str:
        if kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return self.llg.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
        return self.llg.LLMatcher.grammar_from_json_schema(text)

    def compile(self, kind: str, text: str) -> Any:
        g = self.grammar_text(kind, text)
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise EngineRejected(m.get_error())
        return (g, m)

    def validate(self, kind: str, text: str) -> str:
        """validate_grammar's message ("" = valid)."""
        return self.llg.LLMatcher.validate_grammar(self.grammar_text(kind, text), self.tok)

    def first_matcher(self, handle: Any) -> Any:
        return handle[1]

    def matcher(self, handle: Any) -> Any:
        return self.llg.LLMatcher(self.tok, handle[0], log_level=0)

    def fill(self, m: Any, bm: Any) -> None:
        self.lnp.fill_next_token_bitmask(m, bm, 0)

    def consume(self, m: Any, t: int) -> bool:
        return m.consume_token(t)

    def error(self, m: Any) -> str | None:
        return m.get_error() if m.is_error() else None

    def finished(self, m: Any) -> bool:
        return m.is_stopped() or m.is_accepting()

    def grammar_bytes(self, handle: Any) -> int | None:
        return None


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, threads: int) -> None:
        from importlib.metadata import version

        import numpy as np
        import xgrammar

        self.xgr, self.np, self.threads = xgrammar, np, threads
        self.version = version("xgrammar")
        self.torch_version = version("torch")

    def build_tokenizer(self, w: dict[str, Any]) -> None:
        x = self.xgr
        self.info = x.TokenizerInfo(
            w["vocab"], x.VocabType.BYTE_LEVEL, vocab_size=w["vocab_size"], stop_token_ids=w["stop_ids"]
        )
        self.compiler = x.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)

    def alloc(self) -> tuple[Any, Any]:
        bm = self.xgr.allocate_token_bitmask(1, self.info.vocab_size)
        return bm, bm.numpy()

    def compile(self, kind: str, text: str) -> Any:
        try:
            if kind == "gbnf":
                cg = self.compiler.compile_grammar(text)
            else:
                cg = self.compiler.compile_json_schema(text)
        except Exception as e:  # RuntimeError / InvalidJSONError / ValueError from the C++ side
            raise EngineRejected(f"{type(e).__name__}: {_strip_cpp(str(e))}") from None
        return (cg, self.xgr.GrammarMatcher(cg))

    def validate(self, kind: str, text: str) -> str:
        return ""  # xgrammar has no separate validation: compile is the check

    def first_matcher(self, handle: Any) -> Any:
        return handle[1]

    def matcher(self, handle: Any) -> Any:
        return self.xgr.GrammarMatcher(handle[0])

    def fill(self, m: Any, bm: Any) -> None:
        m.fill_next_token_bitmask(bm)

    def consume(self, m: Any, t: int) -> bool:
        return m.accept_token(t)

    def error(self, m: Any) -> str | None:
        return None

    def finished(self, m: Any) -> bool:
        return m.is_terminated() or m.is_completed()

    def grammar_bytes(self, handle: Any) -> int | None:
        return int(handle[0].memory_size_bytes)


def _strip_cpp(msg: str) -> str:
    """``[12:11:17] /project/cpp/x.cc:3562: Circular $ref...`` -> ``Circular $ref...``."""
    msg = msg.strip()
    if msg.startswith("[") and ".cc:" in msg:
        msg = msg.split(": ", 1)[-1]
    return msg


def _allowed(view: Any, t: int) -> bool:
    return bool((int(view[0, t >> 5]) >> (t & 31)) & 1)


def _popcount(np: Any, view: Any) -> int:
    return int(np.unpackbits(np.ascontiguousarray(view).view(np.uint8)).sum())


def _make_engine(name: str, threads: int) -> Any:
    return LLGuidanceEngine() if name == "llguidance" else XGrammarEngine(threads)


def worker_main(args: argparse.Namespace) -> None:
    w = json.loads(Path(args.workload).read_text())
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    eng = _make_engine(args.worker, args.threads)
    import_ms = (time.perf_counter() - t0) * 1e3
    rss_import = _rss_mb()
    if args.bad:
        return _worker_bad(eng, w, args.bad)

    builds = []
    for _ in range(3):
        t0 = time.perf_counter()
        eng.build_tokenizer(w)
        builds.append((time.perf_counter() - t0) * 1e3)
    rss_tok = _rss_mb()
    bm, view = eng.alloc()
    np = eng.np
    specials = [i for i in w["special_ids"] if i not in w["stop_ids"]]
    stop = w["eos_id"]

    out: dict[str, Any] = {
        "engine": eng.name,
        "version": eng.version,
        "torch": getattr(eng, "torch_version", None),
        "import_ms": import_ms,
        "tokenizer_ms": builds,
        "rss_mb": {"start": rss0, "import": rss_import, "tokenizer": rss_tok},
        "grammars": {},
    }
    kept = []
    for g in w["grammars"]:
        compile_ms, compile_cpu_ms, first_ms, grammar_bytes = [], [], [], None
        handle = None
        for _ in range(args.repeats):
            c0 = time.process_time()
            t0 = time.perf_counter()
            try:
                handle = eng.compile(g["kind"], g["text"])
            except EngineRejected as e:
                handle = None
                out["grammars"][g["name"]] = {"rejected": _first_line(str(e))}
                break
            t1 = time.perf_counter()
            c1 = time.process_time()
            eng.fill(eng.first_matcher(handle), bm)
            t2 = time.perf_counter()
            compile_ms.append((t1 - t0) * 1e3)
            compile_cpu_ms.append((c1 - c0) * 1e3)
            first_ms.append((t2 - t1) * 1e3)
        if handle is None:
            continue
        kept.append(handle)
        grammar_bytes = eng.grammar_bytes(handle)
        step_us, step_cpu_us, consume_us, pops, special_hits = [], [], [], [], 0
        walk_error = None
        tokens = g["tokens"] + [stop]
        for walk in range(args.walks):
            m = eng.matcher(handle)
            step_us.append([])
            for i, t in enumerate(tokens):
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                eng.fill(m, bm)
                t1 = time.perf_counter_ns()
                c1 = time.thread_time_ns()
                step_us[-1].append((t1 - t0) / 1e3)
                step_cpu_us.append((c1 - c0) / 1e3)
                if walk == 0:
                    pops.append(_popcount(np, view))
                    special_hits = max(special_hits, sum(_allowed(view, s) for s in specials))
                if not _allowed(view, t):
                    err = eng.error(m)
                    walk_error = f"token {i} ({t}) not in mask" + (f": {_first_line(err)}" if err else "")
                    break
                t2 = time.perf_counter_ns()
                ok = eng.consume(m, t)
                consume_us.append((time.perf_counter_ns() - t2) / 1e3)
                if not ok:
                    walk_error = f"token {i} ({t}) refused by consume: {_first_line(eng.error(m) or '')}"
                    break
            if walk_error is None and not eng.finished(m):
                walk_error = "walk ended but the matcher is not finished"
            if walk_error:
                break
        out["grammars"][g["name"]] = {
            "compile_ms": compile_ms,
            "compile_cpu_ms": compile_cpu_ms,
            "first_mask_ms": first_ms,
            "step_us": step_us,
            "step_cpu_us": step_cpu_us,
            "consume_us": consume_us,
            "tokens": len(tokens),
            "popcounts": pops,
            "special_allowed_max": special_hits,
            "walk_error": walk_error,
            "grammar_bytes": grammar_bytes,
        }
    out["rss_mb"]["compiled"] = _rss_mb()
    out["kept"] = len(kept)
    _emit({"result": out})


def _worker_bad(eng: Any, w: dict[str, Any], name: str) -> None:
    text = bad_inputs()[name]["text"]
    eng.build_tokenizer(w)
    bm, view = eng.alloc()
    res: dict[str, Any] = {"rss_base_mb": _rss_mb()}
    _emit({"phase": "validate", "rss_base_mb": res["rss_base_mb"]})
    t0 = time.perf_counter()
    try:
        v = eng.validate("json", text)
        res["validate"] = "ok" if not v else f"error: {_first_line(v)}"
    except Exception as e:
        res["validate"] = f"raised {type(e).__name__}: {_first_line(str(e))}"
    res["validate_ms"] = (time.perf_counter() - t0) * 1e3
    _emit({"phase": "compile", **res})
    t0 = time.perf_counter()
    try:
        handle = eng.compile("json", text)
        res["compile"] = "ok"
    except EngineRejected as e:
        handle = None
        res["compile"] = f"rejected: {_first_line(str(e))}"
    except Exception as e:
        handle = None
        res["compile"] = f"raised {type(e).__name__}: {_first_line(str(e))}"
    res["compile_ms"] = (time.perf_counter() - t0) * 1e3
    _emit({"phase": "first_mask", **res})
    if handle is not None:
        m = eng.first_matcher(handle)
        t0 = time.perf_counter()
        eng.fill(m, bm)
        res["mask_ms"] = (time.perf_counter() - t0) * 1e3
        res["mask_allowed"] = _popcount(eng.np, view)
        res["mask_ids"] = [i for i in range(min(view.shape[1] * 32, 50_000)) if _allowed(view, i)][:5]
        err = eng.error(m)
        res["mask_error"] = _first_line(err) if err else None
        res["grammar_bytes"] = eng.grammar_bytes(handle)
    res["rss_end_mb"] = _rss_mb()
    res["hwm_end_mb"] = _rss_mb("VmHWM:")
    _emit({"result": res})


# ---------------------------------------------------------------------------------------------------
# Parent side: the project's venv
# ---------------------------------------------------------------------------------------------------


def build_workload(path: Path) -> dict[str, Any]:
    import jsonschema

    sys.path.insert(0, str(ROOT))
    from backend.model_path import default_model_path
    from templating.tokenizer import load_tokenizer

    tk = load_tokenizer(default_model_path())
    vocab = [""] * tk.vocab_size
    for s, i in tk.tokenizer.get_vocab().items():
        vocab[i] = s
    grammars = []
    for entry in json.loads(SCHEMAS.read_text()):
        name, schema = entry["name"], entry["schema"]
        if name not in EXAMPLES:
            raise SystemExit(f"bench/grammar_engines.py: no example instance for schema {name!r}")
        jsonschema.validate(EXAMPLES[name], schema)
        text = json.dumps(EXAMPLES[name])
        grammars.append(
            {"name": name, "kind": "json", "text": json.dumps(schema), "tokens": tk.encode_plain(text)}
        )
    grammars.append(
        {"name": "tool_call_gbnf", "kind": "gbnf", "text": TOOL_GBNF, "tokens": tk.encode_plain(TOOL_EXAMPLE)}
    )
    w = {
        "tokenizer_json": tk.tokenizer.to_str(),
        "vocab": vocab,
        "vocab_size": tk.vocab_size,
        "stop_ids": sorted(tk.stop_token_ids),
        "eos_id": tk.eos_token_id if tk.eos_token_id is not None else sorted(tk.stop_token_ids)[0],
        "special_ids": sorted(tk.special_ids),
        "grammars": grammars,
    }
    path.write_text(json.dumps(w))
    return w


def run_child(cmd: list[str], timeout: float, rss_cap_mb: float) -> dict[str, Any]:
    """Run a worker, polling its RSS; kill it over ``timeout`` s or ``rss_cap_mb``. Its JSON lines + fate."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        peak, killed = 0.0, None
        while p.poll() is None:
            try:
                for line in open(f"/proc/{p.pid}/status"):
                    if line.startswith("VmRSS:"):
                        peak = max(peak, int(line.split()[1]) / 1024)
            except OSError:
                pass
            el = time.perf_counter() - t0
            if el > timeout:
                killed = f"killed after {el:.0f} s (timeout)"
            elif peak > rss_cap_mb:
                killed = f"killed after {el:.1f} s (RSS {peak:.0f} MB > {rss_cap_mb:.0f} MB)"
            if killed:
                p.kill()
                p.wait()
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        lines = [json.loads(x) for x in out.read().decode().splitlines() if x.startswith("{")]
        stderr = err.read().decode(errors="replace")
    return {
        "lines": lines,
        "killed": killed,
        "rc": p.returncode,
        "wall_s": wall,
        "peak_rss_mb": peak,
        "stderr": stderr[-2000:],
    }


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    gs = [g for g in r["grammars"].values() if "compile_ms" in g]
    comp = [x for g in gs for x in g["compile_ms"]]
    first = [x for g in gs for x in g["first_mask_ms"]]
    ready = [a + b for g in gs for a, b in zip(g["compile_ms"], g["first_mask_ms"])]
    steps = [x for g in gs for w in g["step_us"] for x in w]
    cpu = [x for g in gs for x in g["step_cpu_us"]]
    ccpu = [x for g in gs for x in g["compile_cpu_ms"]]
    cold = [x for g in gs for x in g["step_us"][0]]
    warm = [x for g in gs for w in g["step_us"][1:] for x in w]
    cold_walk = [sum(g["step_us"][0]) / 1e3 for g in gs]
    warm_walk = [sum(w) / 1e3 for g in gs for w in g["step_us"][1:]]
    cons = [x for g in gs for x in g["consume_us"]]
    gb = [g["grammar_bytes"] for g in gs if g["grammar_bytes"] is not None]
    return {
        "tok_ms": pct(r["tokenizer_ms"], 50),
        "compile_p50": pct(comp, 50),
        "compile_p99": pct(comp, 99),
        "first_p50": pct(first, 50),
        "ready_p50": pct(ready, 50),
        "ready_p99": pct(ready, 99),
        "step_p50": pct(steps, 50),
        "step_p99": pct(steps, 99),
        "step_max": max(steps) if steps else float("nan"),
        "cold_p99": pct(cold, 99),
        "cpu_p50": pct(cpu, 50),
        "step_mean": sum(steps) / len(steps) if steps else float("nan"),
        "cpu_mean": sum(cpu) / len(cpu) if cpu else float("nan"),
        "cpu_p99": pct(cpu, 99),
        "cpu_max": max(cpu) if cpu else float("nan"),
        "compile_cpu_p50": pct(ccpu, 50),
        "compile_cpu_p99": pct(ccpu, 99),
        "warm_p99": pct(warm, 99),
        "cold_walk_ms": pct(cold_walk, 50),
        "warm_walk_ms": pct(warm_walk, 50),
        "cold_walk_max_ms": max(cold_walk) if cold_walk else float("nan"),
        "consume_p50": pct(cons, 50),
        "n_steps": len(steps),
        "n_compiles": len(comp),
        "rss_tok": r["rss_mb"]["tokenizer"] - r["rss_mb"]["import"],
        "rss_compiled": r["rss_mb"]["compiled"] - r["rss_mb"]["tokenizer"],
        "grammar_mb": sum(gb) / 2**20 if gb else None,
        "errors": {n: g.get("walk_error") or g.get("rejected") for n, g in r["grammars"].items()}
        if any(g.get("walk_error") or g.get("rejected") for g in r["grammars"].values())
        else {},
        "special_allowed": {
            n: g["special_allowed_max"] for n, g in r["grammars"].items() if g.get("special_allowed_max")
        },
    }


def _bad_outcome(res: dict[str, Any]) -> str:
    if res["killed"]:
        last = res["lines"][-1] if res["lines"] else {}
        return f"{res['killed']} during {last.get('phase', 'start-up')}"
    lines = [x for x in res["lines"] if "result" in x]
    if not lines:
        return f"crashed (rc {res['rc']}): {_first_line(res['stderr'])}"
    r = lines[-1]["result"]
    parts = []
    if r.get("validate") not in (None, "ok") or "llguidance" in res.get("engine", ""):
        parts.append(f"validate: {r['validate']} ({r['validate_ms']:.1f} ms)")
    parts.append(f"compile: {r['compile']} ({r['compile_ms']:.1f} ms)")
    if "mask_ms" in r:
        m = f"first mask {r['mask_ms']:.1f} ms, {r['mask_allowed']} tokens allowed"
        if r["mask_allowed"] <= 5:
            m += f" {r['mask_ids']}"
        if r.get("mask_error"):
            m += f", matcher error: {r['mask_error']}"
        if r.get("grammar_bytes"):
            m += f", compiled grammar {r['grammar_bytes'] / 2**20:.1f} MB"
        parts.append(m)
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: llguidance,xgrammar")
    ap.add_argument("--repeats", type=int, default=20, help="cold compiles per grammar")
    ap.add_argument("--walks", type=int, default=5, help="token-by-token walks per grammar")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="xgrammar compiler threads")
    ap.add_argument("--xgrammar-python", default=os.environ.get("XGRAMMAR_PYTHON", "/tmp/xgv/bin/python"))
    ap.add_argument("--no-bad", action="store_true", help="skip the bad-input checks")
    ap.add_argument("--bad-only", action="store_true", help="only the bad-input checks")
    ap.add_argument("--bad-cases", help="comma-separated subset of the bad inputs (default: all)")
    ap.add_argument("--bad-timeout", type=float, default=30.0, help="seconds per bad input and engine")
    ap.add_argument("--bad-rss-mb", type=float, default=4096.0, help="RSS cap per bad input and engine")
    ap.add_argument("--json", help="write the raw results here")
    # worker mode (re-invoked by the parent, possibly with another venv's python)
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--bad", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_name  # bench/machine.py

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    pythons = {"llguidance": sys.executable, "xgrammar": args.xgrammar_python}
    if "xgrammar" in engines:
        probe = None
        if Path(args.xgrammar_python).exists():
            probe = subprocess.run(
                [args.xgrammar_python, "-c", "import xgrammar, numpy"], capture_output=True, text=True
            )
        if probe is None or probe.returncode != 0:
            print(
                f"NOTE: xgrammar is not importable with {args.xgrammar_python} "
                "(see the module docstring for its venv): measuring llguidance only.\n"
            )
            engines = [e for e in engines if e != "xgrammar"]

    print(
        f"machine: {cpu_name()}, {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}"
    )
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as td:
        wpath = Path(td) / "workload.json"
        w = build_workload(wpath)
        print(
            f"workload: {len(w['grammars'])} grammars, instance tokens "
            f"{min(len(g['tokens']) for g in w['grammars'])}-{max(len(g['tokens']) for g in w['grammars'])}, "
            f"vocab {w['vocab_size']}, stop ids {w['stop_ids']}; repeats {args.repeats}, walks {args.walks}, "
            f"xgrammar threads {args.threads}\n"
        )
        results: dict[str, Any] = {}
        base = [__file__, "--workload", str(wpath), "--threads", str(args.threads)]
        if not args.bad_only:
            for e in engines:
                cmd = [
                    pythons[e],
                    *base,
                    "--worker",
                    e,
                    "--repeats",
                    str(args.repeats),
                    "--walks",
                    str(args.walks),
                ]
                res = run_child(cmd, timeout=600, rss_cap_mb=16_384)
                got = [x["result"] for x in res["lines"] if "result" in x]
                if not got:
                    raise SystemExit(f"{e} worker failed ({res['killed'] or res['rc']}):\n{res['stderr']}")
                results[e] = got[0]
            report(results)
        bad: dict[str, dict[str, Any]] = {}
        if not args.no_bad:
            cases = bad_inputs()
            if args.bad_cases:
                wanted = [c.strip() for c in args.bad_cases.split(",") if c.strip()]
                unknown = sorted(set(wanted) - set(cases))
                if unknown:
                    raise SystemExit(f"unknown bad inputs {unknown}; known: {', '.join(cases)}")
                cases = {k: v for k, v in cases.items() if k in wanted}
            print("\n## Bad inputs\n")
            print(
                f"(each in its own process, at most {args.bad_timeout:.0f} s and {args.bad_rss_mb:.0f} MB RSS)\n"
            )
            print("| input | " + " | ".join(engines) + " |")
            print("|---|" + "---|" * len(engines))
            for name, case in cases.items():
                row = []
                bad[name] = {}
                for e in engines:
                    cmd = [pythons[e], *base, "--worker", e, "--bad", name]
                    res = run_child(cmd, timeout=args.bad_timeout, rss_cap_mb=args.bad_rss_mb)
                    res["engine"] = e
                    base_rss = next((x["rss_base_mb"] for x in res["lines"] if "rss_base_mb" in x), None)
                    res["outcome"] = _bad_outcome(res)
                    done = [x["result"] for x in res["lines"] if "result" in x]
                    peak = max([res["peak_rss_mb"]] + [d.get("hwm_end_mb", 0) for d in done])
                    if base_rss is not None:
                        res["outcome"] += f"; peak RSS {max(0.0, peak - base_rss):+.0f} MB"
                    bad[name][e] = res
                    row.append(res["outcome"].replace("|", "\\|"))
                size = len(case["text"])
                label = (
                    f"{name} ({case['what']}, {size / 1e3:.0f} KB)"
                    if size > 10_000
                    else f"{name} ({case['what']})"
                )
                print(f"| {label.replace('|', chr(92) + '|')} | " + " | ".join(row) + " |", flush=True)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"engines": results, "bad": bad}, indent=1))
        print(f"raw results: {args.json}")


def report(results: dict[str, Any]) -> None:
    sums = {e: summarize(r) for e, r in results.items()}
    print("## Summary (compile: schema text -> matcher; ready = compile + first mask; mask: per step)\n")
    print(
        "| engine | version | tokenizer build ms | compile p50 / p99 ms (CPU p50 / p99) | first mask p50 ms | "
        "ready p50 / p99 ms | mask p50 / p99 / max µs | mask CPU p50 / p99 / max µs | "
        "mask p99 cold / warm walks µs | walk mask total cold / warm p50 ms | consume p50 µs | "
        "RSS +tokenizer / +13 grammars MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e, s in sums.items():
        r = results[e]
        ver = r["version"] + (f" (torch {r['torch']})" if r.get("torch") else "")
        gm = f" (grammars {s['grammar_mb']:.1f})" if s["grammar_mb"] is not None else ""
        print(
            f"| {e} | {ver} | {s['tok_ms']:.0f} | {s['compile_p50']:.2f} / {s['compile_p99']:.2f} "
            f"({s['compile_cpu_p50']:.2f} / {s['compile_cpu_p99']:.2f}) | "
            f"{s['first_p50']:.3f} | {s['ready_p50']:.2f} / {s['ready_p99']:.2f} | "
            f"{s['step_p50']:.0f} / {s['step_p99']:.0f} / {s['step_max']:.0f} | "
            f"{s['cpu_p50']:.0f} / {s['cpu_p99']:.0f} / {s['cpu_max']:.0f} | "
            f"{s['cold_p99']:.0f} / {s['warm_p99']:.0f} | {s['cold_walk_ms']:.2f} / {s['warm_walk_ms']:.2f} | "
            f"{s['consume_p50']:.1f} | "
            f"{s['rss_tok']:.0f} / {s['rss_compiled']:.0f}{gm} |"
        )
    for e, s in sums.items():
        print(
            f"\n{e}: {s['n_compiles']} compiles, {s['n_steps']} mask steps; import {results[e]['import_ms']:.0f} ms; "
            f"tokenizer builds {', '.join(f'{x:.0f}' for x in results[e]['tokenizer_ms'])} ms; "
            f"mask mean {s['step_mean']:.1f} µs wall, {s['cpu_mean']:.1f} µs CPU"
        )
        if s["errors"]:
            print(f"  PROBLEMS: {s['errors']}")
        if s["special_allowed"]:
            print(f"  special (non-stop) tokens allowed by some mask: {s['special_allowed']}")
    print(
        "\n## Per grammar (compile p50 ms | first mask p50 ms | mask p50/p99 µs | "
        "mask total of the cold / a warm walk ms; CPU: the thread's CPU time)\n"
    )
    engines = list(results)
    print("| grammar | tokens | " + " | ".join(engines) + " |")
    print("|---|---|" + "---|" * len(engines))
    names = list(next(iter(results.values()))["grammars"])
    for n in names:
        cells, ntok = [], ""
        for e in engines:
            g = results[e]["grammars"].get(n, {})
            if "compile_ms" not in g:
                cells.append(f"rejected: {g.get('rejected')}")
                continue
            ntok = str(g["tokens"])
            steps = [x for w in g["step_us"] for x in w]
            cells.append(
                f"{pct(g['compile_ms'], 50):.2f} \\| {pct(g['first_mask_ms'], 50):.2f} \\| "
                f"{pct(steps, 50):.0f}/{pct(steps, 99):.0f} (CPU {pct(g['step_cpu_us'], 99):.0f}) \\| "
                f"{sum(g['step_us'][0]) / 1e3:.2f}/{pct([sum(w) / 1e3 for w in g['step_us'][1:]], 50):.2f}"
                + (f" ({g['walk_error']})" if g.get("walk_error") else "")
            )
        print(f"| {n} | {ntok} | " + " | ".join(cells) + " |")
    if len(engines) == 2:
        a, b = (results[e]["grammars"] for e in engines)
        same = total = 0
        diffs = []
        for n in names:
            pa, pb = a.get(n, {}).get("popcounts", []), b.get(n, {}).get("popcounts", [])
            for i, (x, y) in enumerate(zip(pa, pb)):
                total += 1
                same += x == y
                if x != y:
                    diffs.append((n, i, x, y))
        print(
            f"\nmask agreement (allowed-token counts on the first walk): {same}/{total} steps equal"
            + (f"; e.g. {', '.join(f'{n}[{i}]: {x} vs {y}' for n, i, x, y in diffs[:6])}" if diffs else "")
        )


if __name__ == "__main__":
    main()
