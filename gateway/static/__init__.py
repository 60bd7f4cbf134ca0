"""The playground page: static files served by the gateway itself (no build step, no CDN).

``playground_routes()`` returns Starlette routes for ``GET /`` (index.html) and
``GET /static/{name}`` (app.js, app.css). Mount them on the gateway app without auth (the page holds
no secret; the API key is pasted by the user and kept in the browser's localStorage).

Files are read once at import; responses carry ``Cache-Control: no-cache`` (revalidate, so an
upgraded gateway serves the new page), ``X-Content-Type-Options: nosniff`` and a Content Security
Policy that forbids any script or style not served by the gateway (``connect-src *`` so the page can
call another API base URL).
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

DIR = Path(__file__).resolve().parent
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
ASSETS = ("app.js", "app.css")
CSP = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src *; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"


def _headers(name: str) -> dict[str, str]:
    return {"cache-control": "no-cache", "x-content-type-options": "nosniff", "content-security-policy": CSP,
            "content-type": TYPES[Path(name).suffix]}


def _read(name: str) -> bytes:
    return (DIR / name).read_bytes()


def playground_routes(prefix: str = "") -> list[Route]:
    """Routes ``GET {prefix}/`` and ``GET {prefix}/static/{name}``; unknown asset names -> 404.

    Raises:
        FileNotFoundError: at call time, when a file is missing from the installed package.
    """
    files = {n: _read(n) for n in ("index.html", *ASSETS)}

    async def index(request: Request) -> Response:
        return Response(files["index.html"], headers=_headers("index.html"))

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return Response(b'{"error":{"message":"Not found","type":"invalid_request_error","param":null,"code":null}}',
                            status_code=404, media_type="application/json")
        return Response(files[name], headers=_headers(name))

    return [Route(prefix + "/", index, methods=["GET", "HEAD"]), Route(prefix + "/static/{name}", asset, methods=["GET", "HEAD"])]


__all__ = ["playground_routes", "DIR"]
