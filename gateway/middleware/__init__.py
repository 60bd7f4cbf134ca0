"""ASGI middleware of the gateway, outermost first as ``gateway.app.build_app`` stacks them: CORS (``cors``),
the drain gate (``drain``), observability (request ids, access log), the hop guard (``hops``: 508 for a
request that has passed through this gateway), then inside Starlette the auth middleware. ``asgi`` holds the ASGI callable types they share."""
