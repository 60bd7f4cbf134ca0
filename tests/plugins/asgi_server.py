"""``served(app)``: an ASGI app served by real hypercorn (trio worker) on a free loopback port, with an
``httpx.AsyncClient`` on it; leaving the block stops the server."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve


@asynccontextmanager
async def served(app, *, timeout: float = 10.0) -> AsyncIterator[httpx.AsyncClient]:
    cfg = Config()
    cfg.bind = ["127.0.0.1:0"]
    cfg.accesslog = logging.getLogger("test.access")
    cfg.errorlog = logging.getLogger("test.error")
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, cfg, shutdown_trigger=done.wait))
        async with httpx.AsyncClient(base_url=binds[0], timeout=timeout) as client:
            yield client
        done.set()
