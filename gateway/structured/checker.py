"""Checks a grammar before the request is sent: size, ``$ref`` cycles, then a compile and a first mask in
a worker thread under a time limit. A grammar that fails any of them is a 400 naming the parameter,
before any SSE byte and before the backend sees it; one that passes is remembered (by ``Grammar.key``) so
that the next request with it costs nothing.

``GrammarChecker.check(grammar, param)``:

1. ``len(source)`` over ``max_bytes`` -> 400 ``invalid_value`` ("too large");
2. JSON Schema: a ``$ref`` chain that comes back to itself without describing anything (``{"$ref": "#/$defs/a"}``
   where ``a`` is ``{"$ref": "#/$defs/a"}``, directly or through other refs) -> 400. Recursive schemas that
   do describe something on the way (a tree node with a ``children`` array of nodes) are fine;
3. ``backend.grammar.check_grammar`` against the model's vocabulary (llguidance ``LLTokenizer``, built on
   first use from the gateway's tokenizer) in a worker thread (at most ``threads`` at once): it compiles
   the grammar with llguidance's work limits and computes the first mask. Over ``timeout`` seconds -> 400
   (the thread is abandoned; the work limits end it soon after).

Errors raised: ``InvalidRequest`` (400). No llguidance in this environment: ``InvalidRequest``
``unsupported_parameter``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from backend import grammar as G
from backend.protocol import Grammar
from gateway.errors import InvalidRequest

_OK_CACHE = 1024  # grammar keys known to be fine


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


def _only_ref(node: Any) -> str | None:
    """The ``$ref`` of a node that says nothing else (its content is all the referenced node's)."""
    if isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) <= _ANNOTATIONS | {"$defs"}:
        return node["$ref"]
    return None


def ref_cycle(schema: Any) -> list[str] | None:
    """A chain of ``$ref`` that comes back to where it started without describing anything, or None."""
    if not isinstance(schema, dict):
        return None
    stack: list[Any] = [schema]
    seen_nodes = 0
    while stack and seen_nodes < 100_000:
        node = stack.pop()
        seen_nodes += 1
        if isinstance(node, dict):
            ref = _only_ref(node)
            if ref is not None:
                chain, cur = [ref], _pointer(schema, ref)
                while (nxt := _only_ref(cur)) is not None:
                    if nxt in chain:
                        return chain + [nxt]
                    chain.append(nxt)
                    cur = _pointer(schema, nxt)
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

    def _compile(self, grammar: Grammar) -> None:
        G.check_grammar(grammar, self._llg_tokenizer())

    async def check(self, grammar: Grammar, param: str) -> None:
        """Raise ``InvalidRequest`` naming ``param`` unless ``grammar`` is fit to send (module docstring)."""
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
        if grammar.kind == "json_schema":
            try:
                cycle = ref_cycle(msgspec.json.decode(grammar.source))
            except msgspec.DecodeError:
                cycle = None  # reported by the compile below
            if cycle:
                raise InvalidRequest(
                    f"Invalid value for '{param}': '$ref' cycle {' -> '.join(cycle)} describes no value.",
                    param=param,
                    code="invalid_value",
                )
        error: str | None = None
        with trio.move_on_after(self.timeout) as scope:
            try:
                await trio.to_thread.run_sync(
                    self._compile, grammar, limiter=self._limiter, abandon_on_cancel=True
                )
            except G.GrammarUnavailable as exc:
                raise InvalidRequest(
                    f"'{param}' is not supported: {exc}.", param=param, code="unsupported_parameter"
                ) from None
            except G.GrammarError as exc:
                error = str(exc)
        if scope.cancelled_caught:
            raise InvalidRequest(
                f"Invalid value for '{param}': the grammar did not compile within {self.timeout:g} s.",
                param=param,
                code="invalid_value",
            )
        if error is not None:
            raise InvalidRequest(
                f"Invalid value for '{param}': {error[:500]}", param=param, code="invalid_value"
            )
        self._ok[grammar.key] = None
        while len(self._ok) > _OK_CACHE:
            self._ok.popitem(last=False)
