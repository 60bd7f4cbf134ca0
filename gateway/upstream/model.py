"""``OpenAIUpstream``: one served model of kind ``openai`` (the catalog's ``UpstreamModel``).

It owns the model's ``UpstreamClient`` (one ``httpx.AsyncClient``, closed by ``aclose`` at shutdown) and,
when a ``tokenizer`` is configured, that tokenizer and its chat template (counting; ``send = "prompt"``).
``open_upstream(name, config, aliases)`` checks the config and loads the tokenizer in a worker thread.

Raises (``open_upstream``): ``UpstreamConfigError`` (a ``ValueError``): a bad URL, an unreadable key, a
tokenizer that cannot be loaded, ``send = "prompt"`` without a chat template; one line naming the field.
"""

from __future__ import annotations

import trio

from gateway.upstream.client import UpstreamClient
from gateway.upstream.config import UpstreamConfig, UpstreamConfigError
from templating import ChatTemplate, TextTokenizer, cached_tokenizer


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
    ) -> None:
        config.check()
        if config.send == "prompt" and template is None:
            raise UpstreamConfigError('send = "prompt" needs a tokenizer with a chat template')
        self.name = name
        self.aliases = tuple(aliases)
        self.config = config
        self.tokenizer = tokenizer
        self.template = template
        self.context_length = config.context_length
        self.client = UpstreamClient(name, config, config.api_key())

    def __repr__(self) -> str:  # never the key
        return f"OpenAIUpstream({self.name!r}, urls={len(self.config.urls)})"

    @property
    def upstream_name(self) -> str:
        """The model name sent to the upstream (``upstream_model``, default the served name)."""
        return self.config.upstream_model or self.name

    async def aclose(self) -> None:
        """Close the HTTP client (its pooled connections)."""
        await self.client.aclose()


def _text_side(name: str, path: str) -> tuple[TextTokenizer, ChatTemplate | None]:
    try:
        tok = cached_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - whatever the loader raises: one line
        why = " ".join(str(exc).split())
        raise UpstreamConfigError(f"cannot load tokenizer {path}: {why}") from None
    try:
        template: ChatTemplate | None = ChatTemplate(tok, None)
    except Exception:  # noqa: BLE001 - no usable template: counting still works
        template = None
    return tok, template


async def open_upstream(name: str, config: UpstreamConfig, aliases: tuple[str, ...] = ()) -> OpenAIUpstream:
    """The model ``name`` of ``config``, its tokenizer (if any) loaded in a worker thread.

    Raises:
        UpstreamConfigError: see the module docstring.
    """
    config.check()
    tok = template = None
    if config.tokenizer is not None:
        tok, template = await trio.to_thread.run_sync(_text_side, name, config.tokenizer)
    return OpenAIUpstream(name, config, aliases=aliases, tokenizer=tok, template=template)
