"""ASGI middleware of the gateway, outermost first as ``gateway.app.build_app`` stacks them: CORS (``cors``),
the drain gate (``drain``), observability (request ids, access log), then inside Starlette the auth
middleware. ``asgi`` holds the ASGI callable types they share."""
