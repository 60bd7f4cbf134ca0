"""Checks a grammar before the request is sent: size, then ``$ref`` cycles and the depth of every chain of
references, a compile and a short walk of masks, in a child process under a time limit. A grammar that fails
any of them is a 400 naming the parameter, before any SSE byte and before the backend sees it; one that
passes is remembered (by ``Grammar.key``) so that the next request with it costs nothing. The run calls it
after admission (``gateway.generation.run``), so a tenant's rate limits bound how much checking it can ask
for.

``GrammarChecker.check(grammar, param, schemas=..., tenant=...)``:

1. ``len(source)`` over ``max_bytes`` -> 400 ``invalid_value`` ("too large"), at once, in the event loop;
2. in a check worker: a child process (``gateway.structured.worker``, started on first use with the
   model's vocabulary; ``workers`` of them), so that native code crashing on a grammar (llguidance) never
   takes the gateway down. Slots are fair between tenants (``gateway.slots``: one at a time per tenant,
   ``workers`` in all), so one tenant's queue of slow grammars delays another tenant's by at most one
   check per tenant ahead of it. The worker checks, each a 400 naming the parameter:

   - JSON Schemas (the grammar's own, and ``schemas``: tool parameters): a ``$ref`` chain that comes back
     to itself without describing anything (``{"$ref": "#/$defs/a"}`` where ``a`` is ``{"$ref":
     "#/$defs/a"}``, directly, through other refs or through one-element ``allOf``/``anyOf``/``oneOf``),
     or a chain of nested and referenced schemas deeper than ``backend.grammar_depth.MAX_GRAMMAR_DEPTH``
     (llguidance's compiler recurses along it without a bound; 3,000 deep crashed it); linear in the
     schema's size. Recursive schemas that describe something on the way (a tree node with a
     ``children`` array of nodes) are fine;
   - then ``backend.grammar.check_grammar`` against the model's vocabulary: the same depth bound for Lark
     rule chains (and ``%json`` inside Lark), a compile under llguidance's work limits, and a few steps of
     masks.

   The time limit (``timeout`` seconds) counts from when a worker takes the check: not the wait for a
   slot (a queue of other tenants' grammars never fails this one), nor a worker's start (the vocabulary's
   load). Over it -> 400, and the worker is killed and replaced. A worker that dies on a grammar (a
   signal, an exit) -> 400 ``invalid_value`` naming the parameter ("the grammar checker crashed on it");
   it is replaced by a fresh one before that request's answer, so the crashing tenant pays the restart.
   A request that goes away mid-check kills its worker (the next check starts another).

A grammar whose cost only shows deeper in the output than the walk goes can still fail during
generation: that request then ends with a ``grammar_error`` (an SSE error event once streaming).

Errors raised: ``InvalidRequest`` (400). No llguidance in this environment, or a worker that cannot load
the vocabulary: ``InvalidRequest`` ``unsupported_parameter``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

from backend import grammar as G
from backend.protocol import Grammar
from gateway.errors import InvalidRequest
from gateway.slots import KeySlots
from gateway.structured import worker as W

log = logging.getLogger("gateway.grammar")

_OK_CACHE = 1024  # grammar keys known to be fine
STARTUP_TIMEOUT_S = 120.0  # a worker's start: Python, llguidance and the vocabulary, on a loaded CPU
_ROOT = str(Path(__file__).resolve().parents[2])  # holds the gateway and backend packages


class GrammarCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One grammar of a request to check: the parameter it came from, and more JSON Schemas inside it
    (tool parameters, each with its parameter) to check for ``$ref`` cycles and depth."""

    grammar: Grammar
    param: str
    schemas: list[tuple[str, Any]] = []


class WorkerDied(Exception):
    """A check worker ended (its exit status or signal in the message)."""


def _how(returncode: int | None) -> str:
    if returncode is None:
        return "closed its pipe"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class _Worker:
    """One check worker process and its pipes (used by one check at a time)."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self._buf = bytearray()

    async def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            await self.proc.stdin.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise WorkerDied(await self._ended()) from None

    async def receive(self) -> W.Message:
        assert self.proc.stdout is not None
        header = W.HEADER.size
        while True:
            if len(self._buf) >= header:
                (size,) = W.HEADER.unpack_from(self._buf)
                if len(self._buf) >= header + size:
                    body = bytes(self._buf[header : header + size])
                    del self._buf[: header + size]
                    return W.decode(body)
            try:
                chunk = await self.proc.stdout.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                raise WorkerDied(await self._ended())
            self._buf += chunk

    async def _ended(self) -> str:
        with trio.move_on_after(5):
            await self.proc.wait()
        return f"its process, pid {self.proc.pid}, {_how(self.proc.returncode)}"

    async def aclose(self) -> None:
        """Kill the process and reap it (cancel-shielded: called from cleanup)."""
        with trio.CancelScope(shield=True):
            if self.proc.returncode is None:
                self.proc.kill()
            with trio.move_on_after(5):
                await self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    await stream.aclose()


class _RunState:
    """What belongs to one Trio run: the fair slots, the idle workers, the setup lock."""

    def __init__(self, workers: int) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.slots = KeySlots(workers)
        self.idle: list[_Worker] = []
        self.setup_lock = trio.Lock()


class GrammarChecker:
    """See the module docstring.

    Args:
        tokenizer_json: the model's ``tokenizer.json`` text (``tokenizers.Tokenizer.to_str()``), or a
            callable returning it (called once, on the first check, in a worker thread).
        vocab_size: the model's logits width.
        eos_token_ids: ids that end a choice.
        max_bytes: largest grammar source, bytes.
        timeout: seconds for one check in a worker (the compile and the walks).
        workers: check worker processes (checks running at once; more wait, one per tenant).

    Attributes:
        started: workers started so far; crashes: workers that died on a grammar.
    """

    def __init__(
        self,
        tokenizer_json: str | Callable[[], str],
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        max_bytes: int = 128 * 1024,
        timeout: float = 2.0,
        workers: int = 2,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.workers = workers
        self._setup: bytes | None = None
        self._state: _RunState | None = None
        self._ok: OrderedDict[str, None] = OrderedDict()
        self.started = 0
        self.crashes = 0

    def _run_state(self) -> _RunState:
        state = self._state
        if state is None or state.token is not trio.lowlevel.current_trio_token():
            if state is not None:  # workers of an earlier Trio run: their pipes belong to it
                for w in state.idle:
                    if w.proc.returncode is None:
                        w.proc.kill()
            state = self._state = _RunState(self.workers)
        return state

    async def _setup_frame(self, state: _RunState) -> bytes:
        async with state.setup_lock:
            if self._setup is None:
                src = self._tokenizer_json
                text = await trio.to_thread.run_sync(src) if callable(src) else src
                setup = W.Setup(
                    tokenizer_json=text, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids
                )
                self._setup = await trio.to_thread.run_sync(W.frame, setup)
            return self._setup

    async def _start(self, state: _RunState) -> _Worker:
        """A new worker, its vocabulary loaded. Raises ``G.GrammarUnavailable``, ``WorkerDied``."""
        setup = await self._setup_frame(state)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])),
        }
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "gateway.structured.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.started += 1
        w = _Worker(proc)
        ok = False
        try:
            with trio.fail_after(STARTUP_TIMEOUT_S):
                await w.send(setup)
                ready = await w.receive()
            if not isinstance(ready, W.Ready):
                raise WorkerDied(f"it answered {type(ready).__name__} to its setup")
            if ready.unavailable is not None:
                raise G.GrammarUnavailable(ready.unavailable)
            ok = True
        except trio.TooSlowError:
            raise WorkerDied(f"it did not start within {STARTUP_TIMEOUT_S:g} s") from None
        finally:
            if not ok:
                await w.aclose()
        return w

    async def _replace(self, state: _RunState) -> None:
        """Start a worker in place of one that died or was killed (errors logged: the next check retries)."""
        try:
            state.idle.append(await self._start(state))
        except (WorkerDied, G.GrammarUnavailable) as exc:
            log.warning("grammar check worker not restarted: %s", exc)

    async def _run(self, state: _RunState, job: bytes, param: str) -> W.Result:
        """One check on an idle or new worker (the caller holds a slot). Raises ``InvalidRequest``."""
        try:
            w = state.idle.pop() if state.idle else await self._start(state)
        except G.GrammarUnavailable as exc:
            raise InvalidRequest(
                f"'{param}' is not supported: {exc}.", param=param, code="unsupported_parameter"
            ) from None
        except WorkerDied as exc:
            raise InvalidRequest(
                f"'{param}' cannot be checked now: the grammar checker failed to start ({exc}).",
                param=param,
                code="unsupported_parameter",
            ) from None
        done = False
        try:
            with trio.move_on_after(self.timeout) as scope:
                await w.send(job)
                result = await w.receive()
                done = True
        except WorkerDied as exc:
            self.crashes += 1
            log.warning("grammar check of '%s' ended its worker: %s", param, exc)
            await w.aclose()
            await self._replace(state)
            raise InvalidRequest(
                f"Invalid value for '{param}': the grammar checker crashed on it ({exc}).",
                param=param,
                code="invalid_value",
            ) from None
        finally:
            if done:
                state.idle.append(w)
            elif w.proc.returncode is None:  # cancelled or over time: its state is unknown
                await w.aclose()
        if scope.cancelled_caught:
            await self._replace(state)
            raise InvalidRequest(
                f"Invalid value for '{param}': the grammar did not compile within {self.timeout:g} s.",
                param=param,
                code="invalid_value",
            )
        if not isinstance(result, W.Result):
            raise InvalidRequest(
                f"'{param}' cannot be checked now.", param=param, code="unsupported_parameter"
            )
        return result

    async def check(
        self,
        grammar: Grammar,
        param: str,
        *,
        schemas: Sequence[tuple[str, Any]] = (),
        tenant: object = None,
    ) -> None:
        """Raise ``InvalidRequest`` naming ``param`` unless ``grammar`` is fit to send (module docstring).

        ``schemas``: more JSON Schemas inside the grammar (tool parameters) to check for ``$ref`` cycles and
        depth, each with the parameter to name. ``tenant``: whose slot the check takes (the tenant id; None:
        one shared key).
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
        size = len(grammar.source.encode(errors="surrogatepass"))
        if size > self.max_bytes:
            raise InvalidRequest(
                f"Invalid value for '{param}': the grammar is {size} bytes; at most {self.max_bytes} are accepted.",
                param=param,
                code="invalid_value",
            )
        try:
            job = W.frame(W.Check(grammar=grammar, schemas=list(schemas)))
        except msgspec.EncodeError:
            raise InvalidRequest(
                f"Invalid value for '{param}': the grammar is not valid Unicode text (a lone surrogate).",
                param=param,
                code="invalid_value",
            ) from None
        state = self._run_state()
        async with state.slots.hold(tenant):
            result = await self._run(state, job, param)
        if result.unavailable is not None:
            raise InvalidRequest(
                f"'{param}' is not supported: {result.unavailable}.",
                param=param,
                code="unsupported_parameter",
            )
        if result.message is not None:
            where = result.where or param
            raise InvalidRequest(
                f"Invalid value for '{where}': {result.message}", param=where, code="invalid_value"
            )
        self._ok[grammar.key] = None
        while len(self._ok) > _OK_CACHE:
            self._ok.popitem(last=False)

    async def aclose(self) -> None:
        """Stop the idle workers of the current run (a busy one is killed by its check's cleanup)."""
        state = self._state
        if state is not None and state.token is trio.lowlevel.current_trio_token():
            while state.idle:
                await state.idle.pop().aclose()
