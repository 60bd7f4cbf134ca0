"""``OpenAIUpstream``: one served model of kind ``openai`` (the catalog's ``UpstreamModel``).

It owns the model's ``UpstreamClient`` (one ``httpx.AsyncClient``, closed by ``aclose`` at shutdown) and,
when a ``tokenizer`` is configured, that tokenizer and its chat template (counting; ``send = "prompt"``).
``open_upstream(settings)`` builds one from its ``[[models]]`` table, the tokenizer loaded in a worker
thread.

Raises (``open_upstream``): ``UpstreamConfigError`` (a ``ValueError``): an unknown key or a wrong type, a
bad URL, an unreadable key, a tokenizer or template that cannot be loaded; one line naming the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import msgspec
import trio

from gateway.upstream.client import UpstreamClient
from gateway.upstream.config import UpstreamConfig, UpstreamConfigError
from templating import ChatTemplate, TextTokenizer, cached_tokenizer

#: Tokens a request may use when the table gives no ``context_length`` (what a request without
#: ``max_tokens`` reserves, less its prompt).
DEFAULT_CONTEXT = 8192


class ModelTable(Protocol):
    """The ``[[models]]`` table of one model (``gateway.sections.ModelSettings``)."""

    name: str
    aliases: list[str]
    tokenizer: str | None
    chat_template: str | None
    context_length: int | None
    upstream: dict[str, str | int | float | bool | list[str]]


class OpenAIUpstream:
    """A model served by an OpenAI-compatible server.

    Attributes:
        name, aliases: the served name and its other names (``gateway.catalog.UpstreamModel``).
        config: its ``UpstreamConfig``; client: its ``UpstreamClient``.
        tokenizer, template: the configured tokenizer and its chat template, or None.
        context_length: tokens a request may use (prompt + completion), for the reservation.
    """

    def __init__(
        self,
        name: str,
        config: UpstreamConfig,
        *,
        aliases: tuple[str, ...] = (),
        tokenizer: TextTokenizer | None = None,
        template: ChatTemplate | None = None,
        context_length: int = DEFAULT_CONTEXT,
    ) -> None:
        config.check(name)
        if config.send == "prompt" and template is None:
            raise UpstreamConfigError(
                f'model {name!r}: send = "prompt" needs a tokenizer with a chat template'
            )
        self.name = name
        self.aliases = tuple(aliases)
        self.config = config
        self.tokenizer = tokenizer
        self.template = template
        self.context_length = context_length
        self.client = UpstreamClient(name, config, config.api_key(name))

    def __repr__(self) -> str:  # never the key
        return f"OpenAIUpstream({self.name!r}, urls={len(self.config.urls)})"

    @property
    def upstream_name(self) -> str:
        """The model name sent to the upstream (``upstream_model``, default the served name)."""
        return self.config.upstream_model or self.name

    async def aclose(self) -> None:
        """Close the HTTP client (its pooled connections)."""
        await self.client.aclose()


def _text_side(name: str, path: str, template_file: str | None) -> tuple[TextTokenizer, ChatTemplate | None]:
    try:
        tok = cached_tokenizer(path)
        source = Path(template_file).read_text(encoding="utf-8") if template_file else None
    except Exception as exc:  # noqa: BLE001 - whatever the loader raises: one line
        why = " ".join(str(exc).split())
        raise UpstreamConfigError(f"model {name!r}: cannot load tokenizer {path}: {why}") from None
    try:
        template: ChatTemplate | None = ChatTemplate(tok, source)
    except Exception:  # noqa: BLE001 - no usable template: counting still works
        template = None
    return tok, template


def upstream_config(table: ModelTable) -> UpstreamConfig:
    """The ``UpstreamConfig`` of ``table.upstream``. Raises ``UpstreamConfigError`` naming the key."""
    try:
        return msgspec.convert(table.upstream, UpstreamConfig)
    except msgspec.ValidationError as exc:
        raise UpstreamConfigError(f"model {table.name!r}: {exc}") from None


async def open_upstream(table: ModelTable) -> OpenAIUpstream:
    """The model of ``table`` (kind ``openai``), its tokenizer (if any) loaded in a worker thread.

    Raises:
        UpstreamConfigError: see the module docstring.
    """
    config = upstream_config(table)
    config.check(table.name)
    tok = template = None
    if table.tokenizer is not None:
        tok, template = await trio.to_thread.run_sync(
            _text_side, table.name, table.tokenizer, table.chat_template
        )
    return OpenAIUpstream(
        table.name,
        config,
        aliases=tuple(table.aliases),
        tokenizer=tok,
        template=template,
        context_length=table.context_length or DEFAULT_CONTEXT,
    )
