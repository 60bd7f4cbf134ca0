"""``generation_response``: the HTTP response of one generation, whichever API renders it.

It runs ``run_generation`` inside ``gateway.streaming.CallResponse`` (cancelled when the client goes
away) with the API's renderer and the access-log observer on the same event stream::

    return generation_response(gw, req, lambda w: ChatStream(gw, req, w), get_record(request))

An ``APIError`` out of the run goes to ``renderer.fail``: before the renderer wrote anything it is a plain
error response with the error's status; afterwards it is the API's in-stream error (an SSE error event, an
NDJSON error line).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from gateway.errors import APIError, InternalError
from gateway.generation.events import Event, EventSink
from gateway.generation.request import GenerationRequest
from gateway.generation.run import run_generation
from gateway.generation.tee import Tee
from gateway.inspector.record import InspectObserver
from gateway.inspector.store import InspectStore
from gateway.observability.record import RecordObserver, RequestRecord
from gateway.state import Gateway
from gateway.streaming import CallResponse, ResponseWriter

log = logging.getLogger("gateway")


class Renderer(Protocol):
    """An API's rendering of a run's events (an ``EventSink``) and of the error that ended it."""

    async def emit(self, event: Event) -> None: ...

    async def fail(self, exc: APIError) -> None: ...


def generation_response(
    gw: Gateway,
    req: GenerationRequest,
    render: Callable[[ResponseWriter], Renderer],
    record: RequestRecord | None = None,
    inspections: InspectStore | None = None,
) -> CallResponse:
    """A response that runs ``req`` and answers through ``render(writer)``; ``record`` (the request's
    ``RequestRecord``) is fed the same events, and so is an ``InspectObserver`` keeping the run's inspection
    record in ``inspections`` when the request asked for one (``req.inspect``)."""

    renderers: list[Renderer] = []

    async def produce(w: ResponseWriter) -> None:
        renderer = render(w)
        renderers.append(renderer)
        sinks: list[EventSink] = [renderer]
        if record is not None:
            sinks.append(RecordObserver(record, req))
        if inspections is not None and req.inspect:
            alias = record.request_id if record is not None else None
            served = req.served or gw.catalog.default
            sinks.append(InspectObserver(inspections, served.text()[0], req, alias))
        try:
            await run_generation(gw, req, Tee(*sinks))
        except APIError as exc:
            await renderer.fail(exc)
        except Exception:  # noqa: BLE001 - a fault of ours: a 500, or the API's in-stream error
            log.exception("generation failed")
            await renderer.fail(InternalError("The server had an error while processing your request."))

    async def fail(w: ResponseWriter, exc: APIError) -> None:  # cut by the drain timeout: the API's error
        await (renderers[0].fail(exc) if renderers else w.error(exc))

    return CallResponse(produce, fail)
