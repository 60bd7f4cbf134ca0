"""Inspection records: what one request went through (the rendered prompt and its tokens, the prefix-cache
hit, the engine's timeline, the usage), kept a short time for the tenant that sent it.

``store.py`` (``InspectStore``: bounded, expiring, per tenant), ``record.py`` (``InspectRecord`` and the
``InspectObserver`` that builds one from a run's events), ``routes.py`` (``GET /v1/inspect/{request_id}``).
"""
