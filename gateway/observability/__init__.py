"""Observability: the per-request record fed by the generation run's events (``record``), the middleware
that owns request ids and the access-log line (``middleware``, ``access_log``), Prometheus metrics
(``metrics``, ``backend_stats``) and scrape parsing for tests and tools (``exposition``)."""
