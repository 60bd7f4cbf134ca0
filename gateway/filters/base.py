"""The hook interface: two points where a content filter can act.

1. **Before scheduling** (``Hook.check_prompt``): sees the tenant id and the request's
   ``messages`` (OpenAI chat format) before the prompt is templated, tokenized or sent to the
   backend. It may *allow* (return ``None``), *rewrite* (return a new messages list, e.g. with
   redactions; never mutate the input) or *block* (raise :class:`PromptBlocked`).
2. **On the output stream** (``Hook.output_scanner`` -> :class:`OutputScanner`): one scanner per
   choice per request. It sees the generated text in windows (:class:`OutputChunk`) before any of
   it is sent, and may pass it on (possibly rewritten, e.g. redacted) or cut the stream
   (return :class:`OutputCut`).

Units: every length and index here is in Python ``str`` characters (Unicode code points), not
tokens or bytes.

Semantics follow Azure OpenAI content filtering
(https://learn.microsoft.com/azure/ai-services/openai/concepts/content-filter): a blocked prompt is
a 400 with code ``content_filter``; a cut output ends with ``finish_reason: "content_filter"``.

A hook that does CPU work on the text (matching) runs it through ``gateway.filters.matching.run_matching``:
off the event loop for large texts, charged to the request's time budget.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

#: The two hook points, as named in config ``"stages"``.
STAGES = ("prompt", "output")

#: Message roles a hook looks at unless configured otherwise.
ALL_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class PromptBlocked(Exception):
    """Raised by ``Hook.check_prompt`` to block a request.

    Args:
        category: short machine-readable category, e.g. ``"blocklist"``, ``"pii"``, ``"violence"``.
            It becomes the key of ``innererror.content_filter_result`` in the 400 response.
        detail: optional extra text for logs only; it is never sent to the client (it could quote
            the prompt).
    """

    def __init__(self, category: str, detail: str = "") -> None:
        super().__init__(category)
        self.category = category
        self.detail = detail


@dataclass(frozen=True)
class OutputChunk:
    """The text an output scanner is asked about, in characters.

    Attributes:
        context: up to ``window`` characters already sent to the client, read-only (for regex
            look-behind and word boundaries across the release point).
        pending: text not yet sent (possibly already rewritten by earlier hooks in the list).
        release: how many leading characters of ``pending`` the filter means to send after this
            call (``0 <= release <= len(pending)``). A scanner may raise it (e.g. to send a whole
            redaction placeholder); the filter never holds back more than ``window`` characters.
        final: True when the stream has ended (``flush``): everything left is released, so matches
            touching the end of ``pending`` are conclusive.
        offset: characters sent to the client before ``pending[0]`` (absolute position).
        tenant_id: the tenant the request belongs to, or None.
    """

    context: str
    pending: str
    release: int
    final: bool
    offset: int
    tenant_id: str | None = None

    def with_pending(self, pending: str, release: int) -> OutputChunk:
        """A copy with rewritten ``pending`` and ``release`` (clamped to ``[0, len(pending)]``)."""
        return replace(self, pending=pending, release=max(0, min(release, len(pending))))


@dataclass(frozen=True)
class OutputCut:
    """Returned by a scanner to cut the stream.

    Attributes:
        at: index into the ``pending`` the scanner was given; ``pending[:at]`` may still be sent
            (after being re-checked by every output hook as final text); nothing from ``at`` on is
            ever sent, nor anything generated later.
        category: category of the violation (key of ``content_filter_results``).
    """

    at: int
    category: str


class OutputScanner:
    """Per-stream state of one hook on the output stream. Override :meth:`scan`."""

    async def scan(self, chunk: OutputChunk) -> OutputChunk | OutputCut:
        """Look at ``chunk``; return it (maybe rewritten via ``chunk.with_pending``) or an ``OutputCut``."""
        return chunk


class Hook:
    """Base class of every filter hook.

    Subclasses set ``type`` (the config ``"type"`` string), implement :meth:`validate` (config
    checking, raising ``ValueError``) and override :meth:`check_prompt` and/or
    :meth:`output_scanner`. A hook instance is shared by all requests of the tenants whose config
    built it, so it must keep no per-request state outside the scanners it returns.

    Attributes:
        name: the hook's name from config (defaults to its type); reported in filter results.
        stages: subset of ``{"prompt", "output"}`` where it runs.
        roles: message roles it inspects on the prompt side.
    """

    type: ClassVar[str] = ""
    #: Stages a hook of this type supports (a config may choose a subset).
    supported_stages: ClassVar[tuple[str, ...]] = STAGES

    def __init__(
        self, name: str, stages: tuple[str, ...], roles: tuple[str, ...] = ALL_ROLES, **params: Any
    ) -> None:
        self.name = name
        self.stages = frozenset(stages)
        self.roles = frozenset(roles)
        self.params = params

    @classmethod
    def validate(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Check the type-specific config members; return them normalized (JSON-serialisable).

        Raises:
            ValueError: on any unknown member, wrong type or out-of-range value.
        """
        if params:
            raise ValueError(f"hook type {cls.type!r}: unknown members {sorted(params)}")
        return {}

    async def check_prompt(
        self, tenant_id: str | None, messages: list[dict[str, Any]]
    ) -> list[dict[str, Any]] | None:
        """Before-scheduling point. Return None to allow, a new list to rewrite; raise PromptBlocked to block."""
        return None

    def output_scanner(self, tenant_id: str | None = None) -> OutputScanner | None:
        """A fresh scanner for one output stream, or None if this hook does not scan output."""
        return None


# ---------------------------------------------------------------- message text helpers


def iter_texts(messages: list[dict[str, Any]], roles: frozenset[str] | None = None):
    """Yield ``(role, text)`` for every text segment: string contents and ``{"type":"text"}`` parts."""
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if roles is not None and role not in roles:
            continue
        c = m.get("content")
        if isinstance(c, str):
            yield role, c
        elif isinstance(c, list):
            for part in c:
                if (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    yield role, part["text"]


def map_texts(
    messages: list[dict[str, Any]], fn, roles: frozenset[str] | None = None
) -> list[dict[str, Any]] | None:
    """Apply ``fn(text) -> text`` to every text segment; return a new list, or None if nothing changed.

    The input is never mutated: changed messages (and their part lists) are shallow-copied.
    """
    out: list[dict[str, Any]] = []
    changed = False
    for m in messages:
        if not isinstance(m, dict) or (roles is not None and m.get("role") not in roles):
            out.append(m)
            continue
        c = m.get("content")
        if isinstance(c, str):
            n = fn(c)
            if n != c:
                m = {**m, "content": n}
                changed = True
        elif isinstance(c, list):
            parts = []
            pchanged = False
            for part in c:
                if (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    n = fn(part["text"])
                    if n != part["text"]:
                        part = {**part, "text": n}
                        pchanged = True
                parts.append(part)
            if pchanged:
                m = {**m, "content": parts}
                changed = True
        out.append(m)
    return out if changed else None
