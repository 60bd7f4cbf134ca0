"""The browser pages: ``GET /`` (the playground, ``static/index.html``), ``GET /admin`` (the operator
dashboard, ``static/admin.html``), both never cached, and ``/static/*`` (their scripts and styles, the
inspector's, and the vendored libraries under ``static/vendor/``). Public paths (no key: a page asks for one
and sends it as a bearer token). The playground itself: docs/playground.md."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"


async def index(request: Request) -> FileResponse:
    """GET /: the playground page."""
    return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-cache"})


async def admin_page(request: Request) -> FileResponse:
    """GET /admin: the operator dashboard page (``static/admin.html``). The page carries no data: its
    script asks for the admin key and sends it on every ``/admin/v1/*`` call."""
    return FileResponse(STATIC_DIR / "admin.html", headers={"cache-control": "no-cache"})


def playground_routes() -> list[BaseRoute]:
    """``/`` and ``/static`` when the static folder is installed, else none."""
    if not STATIC_DIR.is_dir():
        return []
    return [
        Route("/", index, methods=["GET"]),
        Route("/admin", admin_page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
