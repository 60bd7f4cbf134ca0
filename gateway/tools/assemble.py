"""Tool-call pieces (``ToolCallDelta``) of one choice put back together, the way the OpenAI SDK assembles
a stream: per ``index``, the first piece's ``id`` and ``name``, and every ``arguments`` fragment
concatenated."""

from __future__ import annotations

from gateway.tools.parser import ToolCall, ToolCallDelta


class ToolCallAssembler:
    """Collects the pieces of one choice's calls, in call order."""

    __slots__ = ("_ids", "_names", "_args")

    def __init__(self) -> None:
        self._ids: dict[int, str] = {}
        self._names: dict[int, str] = {}
        self._args: dict[int, list[str]] = {}

    def add(self, deltas: list[ToolCallDelta]) -> None:
        for d in deltas:
            if d.id is not None:
                self._ids[d.index] = d.id
            if d.name is not None:
                self._names[d.index] = d.name
            self._args.setdefault(d.index, []).append(d.arguments)

    def calls(self) -> list[ToolCall]:
        """The calls so far, by index (a call announced without arguments has ``arguments`` "")."""
        return [
            ToolCall(id=self._ids.get(i, ""), name=self._names.get(i, ""), arguments="".join(self._args[i]))
            for i in sorted(self._args)
        ]

    def __bool__(self) -> bool:
        return bool(self._args)
