"""Checks a grammar before the request is sent: size, then ``$ref`` cycles, a compile and a short walk of
masks in a worker thread under a time limit. A grammar that fails any of them is a 400 naming the
parameter, before any SSE byte and before the backend sees it; one that passes is remembered (by
``Grammar.key``) so that the next request with it costs nothing. The run calls it after admission
(``gateway.generation.run``), so a tenant's rate limits bound how much checking it can ask for.

``GrammarChecker.check(grammar, param, schemas=...)``:

1. ``len(source)`` over ``max_bytes`` -> 400 ``invalid_value`` ("too large"), at once, in the event loop;
2. in a worker thread (at most ``threads`` at once; the wait for one does not count against the limit):
   JSON Schemas (the grammar's own, and ``schemas``: tool parameters): a ``$ref`` chain that comes back
   to itself without describing anything (``{"$ref": "#/$defs/a"}`` where ``a`` is ``{"$ref":
   "#/$defs/a"}``, directly, through other refs or through one-element ``allOf``/``anyOf``/``oneOf``)
   -> 400; linear in the schema's size. Recursive schemas that do describe something on the way (a tree
   node with a ``children`` array of nodes) are fine;
3. then ``backend.grammar.check_grammar`` against the model's vocabulary (llguidance ``LLTokenizer``,
   built on first use from the gateway's tokenizer): it compiles the grammar with llguidance's work
   limits and walks a few steps of masks. Over ``timeout`` seconds -> 400 (the thread is abandoned; the
   work limits end it soon after).

A grammar whose cost only shows deeper in the output than the walk goes can still fail during
generation: that request then ends with a ``grammar_error`` (an SSE error event once streaming).

Errors raised: ``InvalidRequest`` (400). No llguidance in this environment: ``InvalidRequest``
``unsupported_parameter``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import trio

from backend import grammar as G
from backend.protocol import Grammar
from gateway.errors import InvalidRequest

_OK_CACHE = 1024  # grammar keys known to be fine


class GrammarCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One grammar of a request to check: the parameter it came from, and more JSON Schemas inside it
    (tool parameters, each with its parameter) to check for ``$ref`` cycles."""

    grammar: Grammar
    param: str
    schemas: list[tuple[str, Any]] = []


def _pointer(root: Any, ref: str) -> Any:
    """The node a local JSON pointer (``#/$defs/a``) names, or None."""
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


_ANNOTATIONS = frozenset(
    {"$ref", "title", "description", "$comment", "default", "examples", "$id", "$schema"}
)
_WRAPPERS = ("allOf", "anyOf", "oneOf")


def _only_ref(node: Any) -> str | None:
    """The ``$ref`` of a node that says nothing else (its content is all the referenced node's): a bare
    ``{"$ref": ...}`` (annotations and ``$defs`` aside), or an ``allOf``/``anyOf``/``oneOf`` of one such
    node and nothing else, at any depth of such wrapping."""
    for _ in range(64):
        if not isinstance(node, dict):
            return None
        keys = set(node) - _ANNOTATIONS - {"$defs", "definitions"}
        ref = node.get("$ref")
        if isinstance(ref, str) and not keys:
            return ref
        if ref is None and len(keys) == 1:
            (k,) = keys
            if k in _WRAPPERS and isinstance(node[k], list) and len(node[k]) == 1:
                node = node[k][0]
                continue
        return None
    return None


def ref_cycle(schema: Any, max_nodes: int = 200_000) -> list[str] | None:
    """A chain of ``$ref`` that comes back to where it started without describing anything, or None.

    O(nodes + refs x pointer depth): every node is visited once (iteratively, never recursing), and
    every ref's chain is followed once (a chain already known to end is not walked again).
    """
    if not isinstance(schema, dict):
        return None
    ends: set[str] = set()  # refs whose chain reaches a node that describes something
    stack: list[Any] = [schema]
    seen = 0
    while stack and seen < max_nodes:
        node = stack.pop()
        seen += 1
        if isinstance(node, dict):
            ref = _only_ref(node)
            if ref is not None and ref not in ends:
                chain: list[str] = []
                on_chain: set[str] = set()
                cur: str | None = ref
                while cur is not None and cur not in ends:
                    if cur in on_chain:
                        return chain[chain.index(cur) :] + [cur]
                    chain.append(cur)
                    on_chain.add(cur)
                    cur = _only_ref(_pointer(schema, cur))
                ends.update(chain)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


class GrammarChecker:
    """See the module docstring.

    Args:
        tokenizer_json: the model's ``tokenizer.json`` text (``tokenizers.Tokenizer.to_str()``), or a
            callable returning it (called once, on the first check, in a worker thread).
        vocab_size: the model's logits width.
        eos_token_ids: ids that end a choice.
        max_bytes: largest grammar source, bytes.
        timeout: seconds for the compile and first mask.
        threads: checks running at once (more wait).
    """

    def __init__(
        self,
        tokenizer_json: str | Callable[[], str],
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        max_bytes: int = 128 * 1024,
        timeout: float = 2.0,
        threads: int = 2,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_bytes = max_bytes
        self.timeout = timeout
        self._limiter = trio.CapacityLimiter(threads)
        self._tokenizer: object | None = None
        self._tok_lock = threading.Lock()
        self._ok: OrderedDict[str, None] = OrderedDict()

    def _llg_tokenizer(self) -> object:
        with self._tok_lock:  # worker threads only
            if self._tokenizer is None:
                compiler = G.GrammarCompiler(self._tokenizer_json, self.vocab_size, self.eos_token_ids)
                self._tokenizer = compiler.tokenizer()
            return self._tokenizer

    def _work(self, grammar: Grammar, schemas: Sequence[tuple[str, Any]]) -> tuple[str | None, str] | None:
        """Steps 2-3 (worker thread): ``(param or None for the grammar's own, message)`` of the first
        problem, or None."""
        docs: list[tuple[str | None, Any]] = list(schemas)
        if grammar.kind == "json_schema":
            try:
                docs.insert(0, (None, msgspec.json.decode(grammar.source)))
            except msgspec.DecodeError:
                pass  # reported by the compile below
        for where, doc in docs:
            cycle = ref_cycle(doc)
            if cycle:
                return where, f"'$ref' cycle {' -> '.join(cycle)} describes no value."
        try:
            G.check_grammar(grammar, self._llg_tokenizer())
        except G.GrammarUnavailable:
            raise
        except G.GrammarError as exc:
            return None, str(exc)[:500]
        return None

    async def check(self, grammar: Grammar, param: str, *, schemas: Sequence[tuple[str, Any]] = ()) -> None:
        """Raise ``InvalidRequest`` naming ``param`` unless ``grammar`` is fit to send (module docstring).

        ``schemas``: more JSON Schemas inside the grammar (tool parameters) to check for ``$ref`` cycles,
        each with the parameter to name. The time limit counts from when a worker thread takes the check,
        not the wait for one (a queue of other tenants' grammars never fails this one).
        """
        if grammar.key in self._ok:
            self._ok.move_to_end(grammar.key)
            return
        if not G.available():
            raise InvalidRequest(
                f"'{param}' is not supported: this server has no grammar engine.",
                param=param,
                code="unsupported_parameter",
            )
        size = len(grammar.source.encode())
        if size > self.max_bytes:
            raise InvalidRequest(
                f"Invalid value for '{param}': the grammar is {size} bytes; at most {self.max_bytes} are accepted.",
                param=param,
                code="invalid_value",
            )
        problem: tuple[str | None, str] | None = None
        async with self._limiter:
            with trio.move_on_after(self.timeout) as scope:
                try:
                    problem = await trio.to_thread.run_sync(
                        self._work, grammar, schemas, abandon_on_cancel=True
                    )
                except G.GrammarUnavailable as exc:
                    raise InvalidRequest(
                        f"'{param}' is not supported: {exc}.", param=param, code="unsupported_parameter"
                    ) from None
        if scope.cancelled_caught:
            raise InvalidRequest(
                f"Invalid value for '{param}': the grammar did not compile within {self.timeout:g} s.",
                param=param,
                code="invalid_value",
            )
        if problem is not None:
            where = problem[0] or param
            raise InvalidRequest(
                f"Invalid value for '{where}': {problem[1]}", param=where, code="invalid_value"
            )
        self._ok[grammar.key] = None
        while len(self._ok) > _OK_CACHE:
            self._ok.popitem(last=False)
