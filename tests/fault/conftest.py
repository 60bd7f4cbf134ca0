"""Shared fixtures of the fault suite (``tests/fault/``): each fault test runs its own gateway.

``fault_gateway`` (session scope) is a factory: ``fault_gateway(*args, **kw)`` starts a private gateway
(``plugins.gateway_server.start_gateway``: tenancy on, a tenant and its API key) in the served default dtype
(bfloat16 on CPU), 3-4x faster than the float32 the e2e tests use for exact logits: a fault test compares no
text, and its time counts against the suite's budget. The caller stops it (``gp.stop()``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
from plugins.gateway_server import GatewayProc, start_gateway


def _start(*args: str, **kw) -> GatewayProc:
    if "dtype" in inspect.signature(start_gateway).parameters:  # older fixture modules take no dtype
        kw.setdefault("dtype", None)
    return start_gateway(*args, **kw)


@pytest.fixture(scope="session")
def fault_gateway() -> Callable[..., GatewayProc]:
    return _start
