"""Fixtures of the rate-limit tests: a real ``redis-server`` per module."""

from __future__ import annotations

import pytest
from plugins.redis_server import start_redis, stop_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """``redis://127.0.0.1:PORT/0`` of a redis-server started for the module (stopped after it)."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop_redis(proc)
