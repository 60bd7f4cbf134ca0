"""The admin API (``/admin/v1``, admin key) and the tenant's own usage (``GET /v1/usage``).

``schemas``: typed request bodies and response objects; ``times``: UNIX-or-ISO time values; ``body``: reading
and decoding a body into a schema type (400 naming the field); ``routes``: the handlers and their routes.
"""
