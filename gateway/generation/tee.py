"""``Tee``: one run's events to several sinks (a renderer and observers), in order."""

from __future__ import annotations

from gateway.generation.events import Event, EventSink


class Tee:
    """An ``EventSink`` that hands each event to ``sinks`` in the order given (the renderer first, so that
    observers see an event once the client was sent it)."""

    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = sinks

    async def emit(self, event: Event) -> None:
        for sink in self.sinks:
            await sink.emit(event)
