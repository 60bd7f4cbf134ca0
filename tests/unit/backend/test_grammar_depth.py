"""The reference-chain depth guard (``backend.grammar_depth``) in front of llguidance's compiler.

llguidance recurses along chains of references with no bound: the inputs below overflowed the stack of the
process that compiled them (SIGSEGV). Each is refused before llguidance sees it, on every path that hands
grammars to llguidance (``backend.grammar.to_llguidance``: the gateway's check workers and the backend's
compile thread), while real-world recursive and nested schemas stay under the bound. The crash inputs run
in a subprocess, so that a missing guard kills that subprocess, not the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend import grammar as G
from backend.grammar_depth import MAX_GRAMMAR_DEPTH, depth_problem, lark_depth, schema_depth
from backend.protocol import Grammar

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not G.available(), reason="llguidance is not installed")


def lark_chain(n: int) -> str:
    """``r0: r1``, ``r1: r2``, ... ``rn: "x"`` (3,000 rules: 37 KB)."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def props_chain(n: int, ref: str = "$ref") -> dict:
    """An object ``$ref`` chain through ``properties`` (1,000 links: 75 KB)."""
    defs: dict = {
        f"d{i}": {"type": "object", "properties": {"a": {ref: f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def id_chain(n: int) -> dict:
    """The same through ``$id`` references (``urn:d1``...)."""
    defs: dict = {
        f"d{i}": {"$id": f"urn:d{i}", "type": "object", "properties": {"a": {"$ref": f"urn:d{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d{n}"] = {"$id": f"urn:d{n}", "type": "string"}
    return {"$ref": "urn:d0", "$defs": defs}


def anchor_chain(n: int) -> dict:
    defs: dict = {
        f"d{i}": {
            "$anchor": f"d{i}",
            "type": "array",
            "items": {"anyOf": [{"type": "null"}, {"$ref": f"#d{i + 1}"}]},
        }
        for i in range(n)
    }
    defs[f"d{n}"] = {"$anchor": f"d{n}", "type": "string"}
    return {"$ref": "#d0", "definitions": defs}


TREE = {  # a recursive node: llguidance compiles it once
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
        }
    },
    "$ref": "#/$defs/node",
}


def test_depths_of_chains_and_of_ordinary_schemas():
    assert schema_depth(props_chain(1000)) == 3003  # three schema objects a link, + the root and the end
    assert schema_depth(id_chain(1000)) == 3003
    assert schema_depth(anchor_chain(1000)) > 3000
    assert schema_depth(props_chain(100, ref="$dynamicRef")) > 300
    assert lark_depth(lark_chain(3000)) == 3002
    assert lark_depth('start: %json {"type": "object", "properties": {"a": {"type": "string"}}}') == 4
    assert lark_depth("start: %json " + json.dumps(props_chain(1000))) > 3000
    assert (
        lark_depth('start: a\na: (((b)))\nb: "x" // (((((((((\n') == 1 + 4 + 1
    )  # groups count, comments not
    assert schema_depth(TREE) < 10
    # data members are no references: "$ref" inside an enum makes no cycle through the root
    assert schema_depth({"type": "object", "properties": {"x": {"enum": [{"$ref": "#"}]}}}) == 4
    assert depth_problem("json_schema", json.dumps(props_chain(150))) is None  # 453 units
    assert depth_problem("lark", lark_chain(500)) is None
    assert depth_problem("regex", "(" * 5000 + "a" + ")" * 5000) is None  # llguidance refuses it itself


CRASH_INPUTS = {
    "properties-ref-chain-1000": ("json_schema", json.dumps(props_chain(1000))),
    "id-ref-chain-3000": ("json_schema", json.dumps(id_chain(3000))),
    "anchor-ref-chain-1500": ("json_schema", json.dumps(anchor_chain(1500))),
    "lark-chain-3000": ("lark", lark_chain(3000)),
    "lark-chain-5000": ("lark", lark_chain(5000)),
    "lark-json-chain-1000": ("lark", "start: %json " + json.dumps(props_chain(1000))),
}

PROBED = ("properties-ref-chain-1000", "lark-chain-3000", "lark-json-chain-1000")  # each in a subprocess
_PROBE = """
import sys, threading
from backend import grammar as G
from backend.protocol import Grammar
kind, source = sys.stdin.read().split("\\n", 1)
threading.stack_size(8 << 20)  # Linux's default; llguidance's compile crashed on these there

def run():
    try:
        G.check_grammar(Grammar(kind=kind, source=source))
        print("compiled")
    except G.GrammarError as exc:
        print("refused:", exc)

t = threading.Thread(target=run)
t.start()
t.join()
"""


def _probe(kind: str, source: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PROBE],
        input=f"{kind}\n{source}",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_crash_inputs_are_refused_before_llguidance_compiles_them():
    """Without the guard each of these killed its process with SIGSEGV (``check_grammar`` compiles; the
    backend's ``GrammarCompiler.compile`` goes through the same ``to_llguidance``)."""
    for name, (kind, source) in CRASH_INPUTS.items():
        with pytest.raises(G.GrammarError, match="deep; at most 512"):
            G.to_llguidance(Grammar(kind=kind, source=source))
        if name not in PROBED:
            continue
        done = _probe(kind, source)
        assert done.returncode == 0 and done.stdout.startswith("refused:"), (
            name,
            done.returncode,
            done.stderr[-500:],
        )


def test_the_bound_is_well_under_llguidance_s_limit():
    """Chains just under ``MAX_GRAMMAR_DEPTH`` compile on an 8 MiB thread stack (the crash limits measured
    on it are 4x and more above: ``backend.grammar_depth``), the costliest kind per unit among them."""
    links = (MAX_GRAMMAR_DEPTH - 3) // 2
    defs: dict = {f"d{i}": {"anyOf": [{"type": "null"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    anyof = {"$ref": "#/$defs/d0", "$defs": defs}
    for kind, source in [("json_schema", json.dumps(anyof)), ("lark", lark_chain(MAX_GRAMMAR_DEPTH - 2))]:
        assert depth_problem(kind, source) is None
        done = _probe(kind, source)
        assert done.returncode == 0 and done.stdout.startswith("compiled"), (
            kind,
            done.returncode,
            done.stdout,
        )
