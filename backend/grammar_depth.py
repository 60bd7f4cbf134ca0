"""How deep llguidance's compiler recurses on a grammar, bounded before llguidance sees it.

llguidance compiles a JSON Schema or a Lark grammar by recursion along every chain of references (a
``$ref`` into a schema that nests more schemas and refers on, a Lark rule whose body names the next
rule), with no depth bound of its own: a long chain overflows the compiling thread's stack and the whole
process dies of SIGSEGV. ``depth_problem(grammar)`` computes an upper bound of that recursion's depth from
the grammar text and refuses (a message; ``backend.grammar.to_llguidance`` raises it as ``GrammarError``)
a grammar deeper than ``MAX_GRAMMAR_DEPTH``. Inline nesting alone never crashed: serde_json stops JSON at
128 levels, and llguidance's Lark and regex parsers refuse deeply nested groups with an error.

Depth units (one unit is at most ~4 KiB of llguidance's stack, measured below):

* JSON Schema (``schema_depth``): JSON objects along a chain that descends into any member (``properties``,
  ``items``, ``anyOf``/``allOf``/``oneOf``, ``additionalProperties``, ``$defs``..., through arrays) and
  follows every reference: ``$ref`` to a JSON pointer (``#/$defs/a``, ``#/definitions/a``, into any
  subschema), to a subschema's ``$id`` (absolute or relative), to an ``$anchor``, ``$dynamicRef`` and
  ``$recursiveRef``. Members holding data (``enum``, ``const``, ``default``, ``examples``) count their
  nesting but their ``$ref`` keys are no references. llguidance compiles a referenced schema once, so a
  chain is a path without repeats: a group of schemas that refer to one another in a cycle (a strongly
  connected component: a recursive tree node) counts as its size, which bounds any path through it.
* Lark (``lark_depth``): rules (and terminals) along a chain of names, each weighing 1 + the deepest
  nesting of groups (``(...)``, ``[...]``, ``%lark {...}``) in its definitions + the ``schema_depth`` of its
  deepest ``%json {...}``; a cycle of rules counts as the sum of its members' weights.

Both are linear in the grammar's size (iterative: no Python recursion); a JSON Schema whose references
resolve to more than ``MAX_REF_EDGES`` targets is refused as too complex.

Measured (llguidance 1.9.1, ``LLMatcher.validate_grammar_with_warnings(grammar, None)``, each input
alone in a fresh subprocess): the chain length at which the process dies of SIGSEGV on an 8 MiB thread
stack (Linux's default ``ulimit -s``), and that length in the units above:

=========================================================  =========  ======
chain                                                      links      units
=========================================================  =========  ======
Lark ``r0: r1``, ``r1: r2``, ...                           ~2,650     2,650
Lark, each body 10 groups deep ``r0: ((((r1))))``...       ~390       4,290
Lark terminals ``T0: T1``, ...                             ~3,500     3,500
Lark ``start: %json {...}`` of the ``properties`` chain    ~920       2,760
``$ref`` through ``properties`` (``{"type": "object",      ~930       2,790
"properties": {"a": {"$ref": ...}}}``)
``$ref`` through ``items``                                 ~1,100     2,200
``$ref`` through ``anyOf: [{"type": "null"}, {"$ref"}]``   ~1,040     2,080
``$ref`` through ``allOf``                                 ~1,350     2,700
``$ref`` through ``additionalProperties``                  ~1,080     2,160
bare ``{"$ref": ...}``                                     ~2,500     2,500
``$ref`` under 20 inline levels of ``properties`` each     ~70        2,870
chains through ``$id`` (``urn:``, relative), ``$anchor``,  < 3,000    --
``#/definitions/``
=========================================================  =========  ======

The Lark chain's limit grows with the stack (~21,500 rules on 64 MiB): about 3 KiB per rule, at most
4 KiB per schema object. ``MAX_GRAMMAR_DEPTH`` (512 units: at most ~2 MiB of stack) is 4x under the lowest
limit measured on 8 MiB, and the threads that compile (``backend.grammar``'s compile thread, the gateway's
check workers) get ``COMPILE_STACK_BYTES`` (64 MiB, reserved, not committed): 30x under theirs. Computing the
token masks of a compiled grammar does not recurse along the chains (a 10,000-rule chain and a
5,000-link ``properties`` chain mask fine on llguidance's own 2 MiB threads).

Source followed: JSON Schema 2020-12 core (``$ref``, ``$id``, ``$anchor``, ``$dynamicRef``; 2019-09
``$recursiveRef``); llguidance's Lark dialect (``docs/syntax.md``: ``%json``, ``%lark``, ``%regex``).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_GRAMMAR_DEPTH = 512  # depth units (module docstring) a grammar may reach
COMPILE_STACK_BYTES = 64 * 1024 * 1024  # stack of the threads that run llguidance's compiler
MAX_REF_EDGES = 1_000_000  # resolved reference targets a schema may have

_DATA = frozenset({"enum", "const", "default", "examples"})
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")


class TooComplex(ValueError):
    """The grammar's references cannot be bounded cheaply (over ``MAX_REF_EDGES``), or its JSON nests
    deeper than Python's parser goes."""


def pointer(root: Any, ref: str) -> Any:
    """The node a local JSON pointer (``#/$defs/a``) names in ``root``, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def longest_path(weights: list[int], edges: list[list[int]]) -> int:
    """The heaviest path's weight in a directed graph (nodes ``0..n-1``, ``edges[i]``: successors of
    ``i``), a strongly connected component counting as the sum of its weights (an upper bound of every
    path without repeats). Iterative Tarjan: components come out successors first, so each one's
    heaviest path is known when it is emitted. O(nodes + edges)."""
    n = len(weights)
    index = [-1] * n
    low = [0] * n
    comp = [-1] * n
    best: list[int] = []  # per component: the heaviest path starting in it
    on_stack = [False] * n
    stack: list[int] = []
    counter = 0
    top = 0
    for start in range(n):
        if index[start] >= 0:
            continue
        work = [(start, 0)]
        while work:
            v, k = work.pop()
            if k == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            succ = edges[v]
            while k < len(succ):
                w = succ[k]
                k += 1
                if index[w] < 0:
                    work.append((v, k))
                    work.append((w, 0))
                    break
                if on_stack[w]:
                    low[v] = min(low[v], index[w])
            else:
                if low[v] == index[v]:
                    members = []
                    while True:
                        w = stack.pop()
                        on_stack[w] = False
                        comp[w] = len(best)
                        members.append(w)
                        if w == v:
                            break
                    c = len(best)
                    out = 0
                    for m in members:
                        for w in edges[m]:
                            if comp[w] != c:
                                out = max(out, best[comp[w]])
                    best.append(sum(weights[m] for m in members) + out)
                    top = max(top, best[-1])
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
    return top


def _last(uri: str) -> str:
    return uri.rstrip("#").rstrip("/").rsplit("/", 1)[-1]


def schema_depth(schema: Any) -> int:
    """An upper bound of llguidance's recursion depth on the JSON Schema ``schema`` (parsed JSON), in
    schema objects (module docstring). Raises ``TooComplex``."""
    nodes: list[dict] = []
    edges: list[list[int]] = []
    refs: list[tuple[int, str, str]] = []  # (node, keyword, target)
    ids: dict[str, list[int]] = {}  # $id (and its last path segment) -> nodes
    anchors: dict[str, list[int]] = {}
    recursive: list[int] = [0]
    by_id: dict[int, int] = {}
    todo: list[tuple[Any, int, bool]] = [(schema, -1, False)]
    while todo:
        obj, parent, data = todo.pop()
        if isinstance(obj, list):
            todo.extend((v, parent, data) for v in obj if isinstance(v, dict | list))
            continue
        i = len(nodes)
        nodes.append(obj)
        edges.append([])
        by_id[id(obj)] = i
        if parent >= 0:
            edges[parent].append(i)
        if not data:
            for key in _REFS:
                if isinstance(obj.get(key), str):
                    refs.append((i, key, obj[key]))
            if isinstance(obj.get("$id"), str):
                for name in {obj["$id"], _last(obj["$id"])}:
                    ids.setdefault(name, []).append(i)
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(obj.get(key), str):
                    anchors.setdefault(obj[key], []).append(i)
            if obj.get("$recursiveAnchor") is True:
                recursive.append(i)
        for k, v in obj.items():
            if isinstance(v, dict | list):
                todo.append((v, i, data or k in _DATA))
    resources = [0] + sorted({i for group in ids.values() for i in group})
    n_edges = 0
    for i, key, ref in refs:
        base, _, frag = ref.partition("#")
        if key == "$recursiveRef":
            targets = list(recursive)
        elif base:
            targets = ids.get(base, []) + ids.get(_last(base), [])
        else:
            targets = resources
        if frag and not frag.startswith("/"):
            found = anchors.get(frag, [])
        else:
            found = [
                t for t in (by_id.get(id(pointer(nodes[r], "#" + frag))) for r in targets) if t is not None
            ]
        if key == "$dynamicRef":
            found = found + anchors.get(frag, [])
        n_edges += len(found) + len(targets)
        if n_edges > MAX_REF_EDGES:
            raise TooComplex(f"its references resolve to more than {MAX_REF_EDGES:,} schemas")
        edges[i].extend(found)
    return longest_path([1] * len(nodes), edges)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEFINITION = re.compile(r"[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?(?:\{[^}\n]*\})?[ \t]*:")
_DIRECTIVES = frozenset({"import", "ignore", "declare", "override", "extend"})
_JSON_BLOCKS = frozenset({"json", "regex", "llguidance"})


def _json_end(src: str, i: int) -> int:
    """The index just after the JSON object or array starting at ``src[i]`` (``len(src)`` if unclosed)."""
    depth = 0
    n = len(src)
    while i < n:
        c = src[i]
        if c == '"':
            i += 1
            while i < n and src[i] != '"':
                i += 2 if src[i] == "\\" else 1
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _quoted_end(src: str, i: int, quote: str) -> int:
    """The index just after the string or regex literal opened by ``src[i] == quote``."""
    n = len(src)
    i += 1
    while i < n and src[i] != quote and src[i] != "\n":
        i += 2 if src[i] == "\\" else 1
    return i + 1


def lark_depth(src: str) -> int:
    """An upper bound of llguidance's recursion depth on the Lark grammar ``src``, in depth units (module
    docstring). Rules of nested ``%lark {...}`` grammars share one namespace (more edges, never fewer).
    Raises ``TooComplex`` (a ``%json`` schema of its own)."""
    weight: dict[str, int] = {}
    names: dict[str, set[str]] = {}
    cur: str | None = None
    depth = 0
    line_start = True
    i, n = 0, len(src)

    def grow(w: int) -> None:
        if cur is not None:
            weight[cur] = max(weight[cur], w)

    while i < n:
        c = src[i]
        if c == "\n":
            line_start = True
            i += 1
            continue
        if c in " \t\r":
            i += 1
            continue
        if line_start and (m := _DEFINITION.match(src, i)):
            cur = m.group(1)
            weight.setdefault(cur, 1)
            names.setdefault(cur, set())
            grow(1 + depth)
            line_start = False
            i = m.end()
            continue
        line_start = False
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif c == '"' or c == "/":
            i = _quoted_end(src, i, c)
        elif c == "<" and src[i + 1 : i + 2] in ("[", "|"):
            j = src.find(">", i)
            i = n if j < 0 else j + 1
        elif c == "%":
            m = _NAME.match(src, i + 1)
            word = m.group(0) if m else ""
            i = m.end() if m else i + 1
            if word in _DIRECTIVES:
                cur = None
            elif word in _JSON_BLOCKS:
                while i < n and src[i] in " \t\r\n":
                    i += 1
                if i < n and src[i] == "{":
                    j = _json_end(src, i)
                    if word == "json":
                        try:
                            doc = json.loads(src[i:j])
                        except RecursionError:
                            raise TooComplex("a '%json' schema nests too deeply") from None
                        except ValueError:
                            doc = None  # llguidance reports it
                        grow(1 + depth + schema_depth(doc))
                    i = j
        elif c in "([{":
            depth += 1
            grow(1 + depth)
            i += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
            i += 1
        elif m := _NAME.match(src, i):
            if cur is not None:
                names[cur].add(m.group(0))
            i = m.end()
        else:
            i += 1
    order = list(weight)
    at = {name: k for k, name in enumerate(order)}
    edges = [[at[r] for r in names[name] if r in at] for name in order]
    return longest_path([weight[name] for name in order], edges)


def depth_problem(kind: str, source: str) -> str | None:
    """Why llguidance must not compile this grammar (``kind``: ``json_schema``, ``lark``, ``regex``;
    ``source``: its text), or None: its depth (module docstring) over ``MAX_GRAMMAR_DEPTH``, or it is
    ``TooComplex``. A JSON Schema that is not valid JSON is left to llguidance to report."""
    try:
        if kind == "json_schema":
            try:
                doc = json.loads(source)
            except RecursionError:
                raise TooComplex("it nests too deeply") from None
            except ValueError:
                return None
            depth, what = schema_depth(doc), "the schema's chain of nested and referenced schemas"
        elif kind == "lark":
            depth, what = lark_depth(source), "the grammar's chain of rules"
        else:
            return None  # regex: no references; llguidance refuses deep groups itself
    except TooComplex as exc:
        return f"the grammar is too complex to compile safely: {exc}"
    if depth > MAX_GRAMMAR_DEPTH:
        return (
            f"{what} is {depth:,} deep; at most {MAX_GRAMMAR_DEPTH} are accepted "
            "(the compiler recurses along it)"
        )
    return None


__all__ = [
    "COMPILE_STACK_BYTES",
    "MAX_GRAMMAR_DEPTH",
    "TooComplex",
    "depth_problem",
    "lark_depth",
    "longest_path",
    "pointer",
    "schema_depth",
]
