"""Shared fixtures of the fault suite (``tests/fault/``).

* ``fault_gateway`` (session scope) is a factory: ``fault_gateway(*args, **kw)`` starts a private gateway
  (``plugins.gateway_server.start_gateway``: tenancy on, a tenant and its API key) in the served default dtype
  (``default_dtype()``: bfloat16 on a CPU with native bf16, 3-4x faster there than the float32 the e2e tests use
  for exact logits; float32 on other CPUs, where emulated bf16 is slower): a fault test compares
  no text, and its time counts against the suite's budget. The caller stops it (``gp.stop()``). Tests that
  kill, stop or restart their gateway or its backend take one of these.
* ``borrow_gateway`` (session scope) is a factory too: ``borrow_gateway()`` gives a view of ONE gateway the
  fault tests that leave it running share (started on first use with ``SHARED_ARGS`` and ``SHARED_ENV``),
  with a tenant and API key of its own; its ``stop()`` only gives the view back. A gateway start costs
  5-20 s on two cores, so sharing keeps the suite inside its time budget. The tests run one after another,
  so counters read before and after a test (engine tokens, KV blocks) are that test's own.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator

import pytest
from plugins.gateway_server import GatewayProc, _setup_tenancy, start_gateway

SHARED_BODY_TIMEOUT = 2.0  # seconds: --body-timeout of the shared gateway (test_slow_body.py)
# seconds: --send-timeout of the shared gateway (test_slow_reader.py; a client resuming sooner keeps its stream)
SHARED_SEND_TIMEOUT = 5.0
SHARED_BACKLOG = 16  # --max-backlog-tokens of the shared gateway (test_slow_reader.py; the default is 256)
# one torch thread: the test's clients (a soak, schemathesis) need the other core
SHARED_ARGS = (
    *("--threads", "1", "--body-timeout", str(SHARED_BODY_TIMEOUT)),
    *("--send-timeout", str(SHARED_SEND_TIMEOUT)),
)
# a grammar holding SHARED_GRAMMAR_ABORT aborts the grammar check worker that checks it (test_grammar_crash.py)
SHARED_GRAMMAR_ABORT = "grammar-worker-abort-fault-test"
SHARED_ENV = {
    "LLM_GATEWAY_MAX_BACKLOG_TOKENS": str(SHARED_BACKLOG),
    "LLM_GATEWAY_TEST_GRAMMAR_ABORT": SHARED_GRAMMAR_ABORT,
}


def _start(*args: str, **kw) -> GatewayProc:
    if "dtype" in inspect.signature(start_gateway).parameters:  # older fixture modules take no dtype
        kw.setdefault("dtype", None)
    return start_gateway(*args, **kw)


@pytest.fixture(scope="session")
def fault_gateway() -> Callable[..., GatewayProc]:
    return _start


class BorrowedGateway(GatewayProc):
    """A view of the shared fault gateway with a tenant of its own: ``stop()`` closes the view's stats client
    and leaves the process running (the session fixture stops it)."""

    def stop(self) -> None:
        client = self.extra.pop("_client", None)
        if client is not None:
            client.close()


@pytest.fixture(scope="session")
def borrow_gateway() -> Iterator[Callable[[], GatewayProc]]:
    shared: list[GatewayProc] = []
    views: list[GatewayProc] = []

    def borrow() -> GatewayProc:
        if not shared:
            shared.append(_start(*SHARED_ARGS, env=SHARED_ENV))
        gp = shared[0]
        fields = {f.name: getattr(gp, f.name) for f in dataclasses.fields(gp)}
        view = BorrowedGateway(**{**fields, "extra": {}})
        _setup_tenancy(view)  # a tenant and key of its own
        views.append(view)
        return view

    try:
        yield borrow
    finally:
        for view in views:
            view.stop()
        for gp in shared:
            gp.stop()
