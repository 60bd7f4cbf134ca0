"""The JSON access log: one line per request on the ``gateway.access`` logger (``RequestRecord.log_fields``).

The line never holds an API key (no header is ever logged) and holds prompt or output text only when
content logging was switched on explicitly (``--log-content``). Destinations: ``"-"`` (stderr), a file
path, or ``"off"``.
"""

from __future__ import annotations

import json
import logging
import sys

from gateway.observability.record import RequestRecord

ACCESS_LOGGER_NAME = "gateway.access"

access_logger = logging.getLogger(ACCESS_LOGGER_NAME)


def emit_access_log(rec: RequestRecord) -> None:
    """Write the record as one compact JSON line on the ``gateway.access`` logger (INFO)."""
    if access_logger.isEnabledFor(logging.INFO):
        access_logger.info(json.dumps(rec.log_fields(), ensure_ascii=False, separators=(",", ":")))


class _AccessHandler(logging.StreamHandler):
    """Marks the handler this module installed (replaced on the next ``configure_access_log``)."""


class _AccessFileHandler(logging.FileHandler):
    """The file flavour of ``_AccessHandler``."""


def configure_access_log(destination: str | None = "-", level: int = logging.INFO) -> logging.Handler | None:
    """Send ``gateway.access`` lines, message only, to stderr (``"-"``), a file path, or nowhere (None/"off").

    Returns the handler installed (None when switched off). Idempotent per destination.
    """
    logger = logging.getLogger(ACCESS_LOGGER_NAME)
    for h in list(logger.handlers):
        if isinstance(h, (_AccessHandler, _AccessFileHandler)):
            logger.removeHandler(h)
            h.close()
    logger.propagate = False
    if destination in (None, "", "off", "none"):
        logger.setLevel(logging.CRITICAL + 1)
        return None
    handler: logging.Handler = (
        _AccessHandler(sys.stderr)
        if destination == "-"
        else _AccessFileHandler(destination, encoding="utf-8")
    )
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
