"""The gateway's grammar checker (``gateway.structured.checker``): checks in worker processes, fair between
tenants, a crashing worker failing only its own request.

Real pieces: the default model's vocabulary, llguidance in ``python -m gateway.structured.worker``
children, Trio.
"""

from __future__ import annotations

import json
import time

import pytest
import trio

from backend import grammar as G
from backend.model_path import default_model_path
from gateway.errors import InvalidRequest
from gateway.structured import formats
from gateway.structured.checker import GrammarChecker
from gateway.structured.worker import ABORT_ENV
from templating.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(not G.available(), reason="llguidance is not installed")
MARKER = "grammar-worker-abort-unit-test"


@pytest.fixture(scope="module")
def tk():
    return load_tokenizer(default_model_path())


def _checker(tk, **kw) -> GrammarChecker:
    return GrammarChecker(tk.tokenizer.to_str, tk.vocab_size, sorted(tk.stop_token_ids), **kw)


def one_field(tag: str):
    return formats.make_grammar(
        "json_schema", json.dumps({"type": "object", "properties": {tag: {"type": "string"}}})
    )


def slow(tag: str):
    """A schema that passes in ~0.5 s of llguidance work (wide integer ranges make big lexer automata)."""
    props = {
        f"{tag}{i}": {"type": "integer", "minimum": -(10**12) + 31 * i, "maximum": 10**15 + 7919 * i}
        for i in range(400)
    }
    return formats.make_grammar(
        "json_schema", json.dumps({"type": "object", "properties": props, "required": list(props)})
    )


async def test_one_tenants_slow_schemas_delay_another_tenant_by_at_most_one_check(tk):
    """One worker, so that every check queues for it: tenant A's 12 slow schemas wait on A's own slot, and B's
    one-field schema waits at most for the one of A's checks that is running (a shared FIFO queue made it
    wait for all twelve)."""
    checker = _checker(tk, workers=1, timeout=30)
    try:
        await checker.check(one_field("warm"), "response_format", tenant="A")  # the worker's start
        t0 = time.monotonic()
        await checker.check(slow("base"), "response_format", tenant="A")
        one_check = time.monotonic() - t0
        t0 = time.monotonic()
        await checker.check(one_field("alone"), "response_format", tenant="B")
        alone = time.monotonic() - t0
        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(lambda i=i: checker.check(slow(f"a{i}_"), "response_format", tenant="A"))
            await trio.sleep(0.1)  # A's first check runs, the other eleven queue
            t0 = time.monotonic()
            await checker.check(one_field("b"), "response_format", tenant="B")
            waited = time.monotonic() - t0
            nursery.cancel_scope.cancel()  # A's checks are not needed any more (their worker is killed)
    finally:
        await checker.aclose()
    print(f"one slow check {one_check:.2f} s, B alone {alone:.2f} s, B behind A's twelve {waited:.2f} s")
    assert waited <= alone + 1.5 * one_check + 0.25, (waited, alone, one_check)


async def test_a_worker_crash_fails_only_its_request(tk, monkeypatch):
    """A worker that aborts (the test-only fault) is a 400 naming the parameter; another tenant's check on
    the other worker meanwhile passes; the crashed worker is replaced, and the next check passes."""
    monkeypatch.setenv(ABORT_ENV, MARKER)
    checker = _checker(tk, workers=2, timeout=30)
    errors: list[InvalidRequest] = []
    try:

        async def crash() -> None:
            try:
                await checker.check(
                    formats.make_grammar("lark", f'start: "{MARKER}"'), "structured_outputs", tenant="A"
                )
            except InvalidRequest as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(crash)
            nursery.start_soon(lambda: checker.check(one_field("other"), "response_format", tenant="B"))
        assert checker.crashes == 1 and checker.started == 3, (checker.crashes, checker.started)
        (err,) = errors
        assert err.status == 400 and err.param == "structured_outputs", err
        assert "crashed" in str(err) and "SIGABRT" in str(err), err
        await checker.check(one_field("after"), "structured_outputs", tenant="A")
        chain = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "x"\n'
        with pytest.raises(InvalidRequest, match="deep; at most 512") as ei:
            await checker.check(formats.make_grammar("lark", chain), "structured_outputs", tenant="A")
        assert ei.value.param == "structured_outputs"
        assert checker.crashes == 1 and checker.started == 3
    finally:
        await checker.aclose()
