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
   built on first use from the gateway's tokenizer, before the time limit starts): it compiles the
   grammar with llguidance's work limits and walks a few steps of masks. Over ``timeout`` seconds -> 400 (the thread is abandoned; the
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
from backend.grammar import ref_cycle
from backend.protocol import Grammar
from gateway.errors import InvalidRequest

_OK_CACHE = 1024  # grammar keys known to be fine


class GrammarCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One grammar of a request to check: the parameter it came from, and more JSON Schemas inside it
    (tool parameters, each with its parameter) to check for ``$ref`` cycles."""

    grammar: Grammar
    param: str
    schemas: list[tuple[str, Any]] = []


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
                if cycle[-1] == "...":
                    return where, f"'$ref' chain {' -> '.join(cycle)} is longer than {G.MAX_REF_CHAIN} links."
                return where, f"'$ref' cycle {' -> '.join(cycle)} describes no value."
        try:
            G.check_grammar(grammar, self._llg_tokenizer())
        except G.GrammarUnavailable:
            raise
        except G.GrammarError as exc:
            return self._blame(schemas) or (None, str(exc)[:500])
        return None

    def _blame(self, schemas: Sequence[tuple[str, Any]]) -> tuple[str, str] | None:
        """The first of ``schemas`` (tool parameters) that fails alone, with its own error: a message about
        the client's schema instead of the tool grammar built around it."""
        for where, doc in schemas:
            text = msgspec.json.encode(doc).decode()
            try:
                G.check_grammar(Grammar(kind="json_schema", source=text), self._llg_tokenizer(), walk=0)
            except G.GrammarError as exc:
                return where, str(exc)[:500]
        return None

    async def check(self, grammar: Grammar, param: str, *, schemas: Sequence[tuple[str, Any]] = ()) -> None:
        """Raise ``InvalidRequest`` naming ``param`` unless ``grammar`` is fit to send (module docstring).

        ``schemas``: more JSON Schemas inside the grammar (tool parameters) to check for ``$ref`` cycles,
        each with the parameter to name. The time limit counts from when a worker thread takes the check,
        not the wait for one (a queue of other tenants' grammars never fails this one), nor the one-time load
        of the model's vocabulary into llguidance.
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
            try:
                # the vocabulary loads once, outside the limit: it is the model's cost, not the grammar's (a
                # 152k-token vocabulary takes seconds on a busy CPU)
                await trio.to_thread.run_sync(self._llg_tokenizer)
                with trio.move_on_after(self.timeout) as scope:
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
