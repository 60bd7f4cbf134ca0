"""The grammar check worker: a child process that runs llguidance for ``gateway.structured.checker``, so
that a crash in native code (SIGSEGV, an abort) ends this process and one request, never the gateway.

Run as ``python -m gateway.structured.worker``. Frames on stdin and stdout: a 4-byte big-endian length,
then the msgpack (msgspec) of one message. The gateway sends ``Setup`` once (the model's vocabulary), the
worker answers ``Ready``; then each ``Check`` is answered by one ``Result``. EOF on stdin ends the worker
(the gateway closed the pipe, or died). The checks run on a thread with
``backend.grammar_depth.COMPILE_STACK_BYTES`` of stack; llguidance's output on stdout goes to stderr, so
that only frames are written to the pipe.

``Check``: 1. the JSON Schemas (the grammar's own and the tool parameters in ``schemas``): a ``$ref`` chain
that comes back to itself without describing anything, or a chain of references deeper than
``backend.grammar_depth.MAX_GRAMMAR_DEPTH`` (either blames the schema's parameter); 2.
``backend.grammar.check_grammar`` against the vocabulary (a compile and short walks of masks; its own
depth guard covers Lark and ``%json`` too); a failing tool grammar is blamed on the first tool parameter
schema that fails alone.

Test-only fault: when the environment variable ``LLM_GATEWAY_TEST_GRAMMAR_ABORT`` holds a non-empty text,
a check whose grammar source contains it aborts this process (SIGABRT) before llguidance runs, as a native
crash would.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any, BinaryIO

import msgspec

from backend import grammar as G
from backend.grammar_depth import COMPILE_STACK_BYTES, MAX_GRAMMAR_DEPTH, TooComplex, schema_depth
from backend.protocol import Grammar

ABORT_ENV = "LLM_GATEWAY_TEST_GRAMMAR_ABORT"
HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # bytes of one message (a vocabulary is a few MB)


class Setup(msgspec.Struct, tag=True):
    """The model's vocabulary: ``tokenizer.json`` text, logits width, ids that end a choice."""

    tokenizer_json: str
    vocab_size: int
    eos_token_ids: list[int]


class Ready(msgspec.Struct, tag=True):
    """``Setup`` done; ``unavailable``: why there is no grammar engine here (no llguidance, a vocabulary
    llguidance cannot load), else None."""

    unavailable: str | None = None


class Check(msgspec.Struct, tag=True):
    """One grammar to check, and the JSON Schemas inside it (tool parameters) with their parameters."""

    grammar: Grammar
    schemas: list[tuple[str, Any]] = []


class Result(msgspec.Struct, tag=True):
    """The first problem: ``where`` (a parameter of ``Check.schemas``; None: the grammar's own) and
    ``message``; both None when the grammar is fine. ``unavailable``: as ``Ready``'s."""

    where: str | None = None
    message: str | None = None
    unavailable: str | None = None


Message = Setup | Ready | Check | Result
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def frame(msg: Message) -> bytes:
    """``msg`` as one frame (header + msgpack). Raises ``msgspec.EncodeError`` (a string that is not valid
    text: a lone surrogate)."""
    body = _encoder.encode(msg)
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> Message:
    return _decoder.decode(body)


def _read(stream: BinaryIO, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _schema_problem(where: str | None, doc: Any) -> tuple[str | None, str] | None:
    cycle = G.ref_cycle(doc)
    if cycle:
        if cycle[-1] == "...":
            return where, f"'$ref' chain {' -> '.join(cycle)} is longer than {G.MAX_REF_CHAIN} links."
        return where, f"'$ref' cycle {' -> '.join(cycle)} describes no value."
    try:
        depth = schema_depth(doc)
    except TooComplex as exc:
        return where, f"the schema is too complex to compile safely: {exc}."
    if depth > MAX_GRAMMAR_DEPTH:
        return where, (
            f"the schema's chain of nested and referenced schemas is {depth:,} deep; "
            f"at most {MAX_GRAMMAR_DEPTH} are accepted."
        )
    return None


class Checker:
    """The worker's state: the llguidance vocabulary (``Setup``) and the checks (``Check``)."""

    def __init__(self, setup: Setup) -> None:
        self.compiler = G.GrammarCompiler(setup.tokenizer_json, setup.vocab_size, setup.eos_token_ids)
        self.tokenizer: object | None = None

    def ready(self) -> Ready:
        try:
            self.tokenizer = self.compiler.tokenizer()
        except G.GrammarUnavailable as exc:
            return Ready(unavailable=str(exc))
        finally:
            self.compiler.close()  # only its vocabulary is used here
        return Ready()

    def check(self, job: Check) -> Result:
        grammar, schemas = job.grammar, job.schemas
        marker = os.environ.get(ABORT_ENV)
        if marker and marker in grammar.source:
            os.abort()
        docs: list[tuple[str | None, Any]] = list(schemas)
        if grammar.kind == "json_schema":
            try:
                docs.insert(0, (None, msgspec.json.decode(grammar.source)))
            except (msgspec.DecodeError, RecursionError):
                pass  # reported by the compile below (its depth guard refuses deep nesting)
        for where, doc in docs:
            problem = _schema_problem(where, doc)
            if problem is not None:
                return Result(where=problem[0], message=problem[1])
        try:
            G.check_grammar(grammar, self.tokenizer)
        except G.GrammarUnavailable as exc:
            return Result(unavailable=str(exc))
        except G.GrammarError as exc:
            where, message = self._blame(schemas) or (None, str(exc)[:500])
            return Result(where=where, message=message)
        return Result()

    def _blame(self, schemas: Sequence[tuple[str, Any]]) -> tuple[str, str] | None:
        """The first of ``schemas`` (tool parameters) that fails alone, with its own error: a message about
        the client's schema instead of the tool grammar built around it."""
        for where, doc in schemas:
            text = msgspec.json.encode(doc).decode()
            try:
                G.check_grammar(Grammar(kind="json_schema", source=text), self.tokenizer, walk=0)
            except G.GrammarError as exc:
                return where, str(exc)[:500]
        return None


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """Answer frames from ``inp`` on ``out`` until EOF (module docstring)."""
    checker: Checker | None = None
    while True:
        header = _read(inp, HEADER.size)
        if header is None:
            return
        (size,) = HEADER.unpack(header)
        if size > MAX_FRAME:
            raise SystemExit(f"grammar worker: a {size}-byte frame")
        body = _read(inp, size)
        if body is None:
            return
        msg = decode(body)
        if isinstance(msg, Setup):
            checker = Checker(msg)
            reply: Message = checker.ready()
        elif isinstance(msg, Check) and checker is not None:
            reply = checker.check(msg)
        else:
            raise SystemExit(f"grammar worker: unexpected {type(msg).__name__}")
        out.write(frame(reply))
        out.flush()


def main() -> None:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray native prints must not corrupt the frames
    inp = sys.stdin.buffer
    threading.stack_size(COMPILE_STACK_BYTES)
    worker = threading.Thread(target=serve, args=(inp, out), name="grammar-check")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
