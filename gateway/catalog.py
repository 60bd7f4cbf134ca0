"""The model catalog: every model one gateway serves, found by its served name or an alias.

``ServedModel`` is one model: its names, its kind and what serves it, with its own tokenizer, chat template
and context length. ``ModelCatalog`` holds them in declaration order (the first is the default model) and
answers which one a request's ``model`` means for a tenant.

Kinds (``ServedModel.kind``):
    ``native``: served by this gateway's own inference backends (``python -m backend``): a ``BackendPool``
        (``ServedModel.pool``, spawned ``replicas`` or remote ``backend_url`` backends), and the
        tokenizer/chat template loaded for that model.
    ``openai``: proxied to an OpenAI-compatible upstream: an ``UpstreamModel`` (``ServedModel.upstream``,
        built by ``gateway.upstream``); no pool. Its tokenizer and template are optional (None: the upstream
        templates and tokenizes).

Adding a model of another kind: build a ``ServedModel(name, kind=..., upstream=obj, aliases=...)`` with an
object that meets ``UpstreamModel`` and hand it to ``ModelCatalog``; the catalog lists it, resolves its names
and calls ``aclose()`` once at shutdown (``ModelCatalog.aclose``). Declared by ``[[models]]`` /
``--serve-model`` (``gateway.sections.ModelSettings``, its kind's own keys in ``ModelSettings.upstream``) and
built at start by ``gateway.launch.served_model``.

Errors (``gateway.errors``)::

    APIError
    ├── NotFound (404, code model_not_found, param model)
    │       resolve(): no model has that name or alias, or the tenant may not use it (the same answer:
    │       a tenant does not learn which models others have)
    └── ServiceUnavailable (503, type server_error)
            ServedModel.card / .context_length: a native model whose backends have not sent their card yet;
            ServedModel.text() / .grammars: a model without a tokenizer in this gateway

Names: a model's served name comes first, then its aliases (vLLM's ``--served-model-name`` lists them the
same way in ``/v1/models``; an unknown model is OpenAI's 404 ``model_not_found``). The default model declared by the single-model flags (``--model``,
``--served-model-name``) has no fixed name: it is the backend's model card name, read on each call, with the
``[http] served_model_name`` entries as aliases.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol, runtime_checkable

from auth.principal import Principal
from backend.protocol import ModelCard
from gateway.backends.pool import BackendPool
from gateway.errors import NotFound, ServiceUnavailable
from gateway.structured.checker import GrammarChecker
from templating import ChatTemplate, TextTokenizer

Kind = Literal["native", "openai"]
KINDS: tuple[Kind, ...] = ("native", "openai")


@runtime_checkable
class UpstreamModel(Protocol):
    """A model served by something other than this gateway's backends (kind ``openai``: an OpenAI-compatible
    server). The catalog reads ``name``, ``aliases`` and ``context_length`` (tokens a request may use) when it
    is built and calls ``aclose()`` once at shutdown (cancel-shielded by the caller; it must return within a
    few seconds)."""

    name: str
    aliases: tuple[str, ...]
    context_length: int

    async def aclose(self) -> None: ...


class ServedModel:
    """One served model.

    Args:
        name: the served name; None only for the default model of the single-model flags (then the
            backend card's name, read on each call; "" before the first card).
        kind: ``"native"`` (needs ``pool``) or ``"openai"`` (needs ``upstream``).
        aliases: other names that resolve to this model (listed after ``name``).
        pool: the native model's backends (one ``BackendPool`` per model).
        upstream: the openai-kind model's upstream.
        tokenizer, template: this model's text side (None for an upstream that tokenizes itself).
        context_length: tokens a request may use (prompt + completion); None: the backend card's.
        grammar_max_bytes, grammar_timeout: limits of this model's grammar checker (``[http]``).

    Raises:
        ValueError: a native model without a pool, an openai model without an upstream, an unknown kind.
    """

    def __init__(
        self,
        name: str | None,
        *,
        kind: Kind = "native",
        aliases: tuple[str, ...] | list[str] = (),
        pool: BackendPool | None = None,
        upstream: UpstreamModel | None = None,
        tokenizer: TextTokenizer | None = None,
        template: ChatTemplate | None = None,
        context_length: int | None = None,
        grammar_max_bytes: int = 128 * 1024,
        grammar_timeout: float = 2.0,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"model kind must be one of {', '.join(KINDS)}, not {kind!r}")
        if kind == "native" and pool is None:
            raise ValueError(f"the native model {name!r} needs a backend pool")
        if kind == "openai" and upstream is None:
            raise ValueError(f"the openai model {name!r} needs an upstream")
        self._name = name
        self.kind: Kind = kind
        self.aliases = tuple(aliases)
        self.pool = pool
        self.upstream = upstream
        self.tokenizer = tokenizer
        self.template = template
        self._context_length = context_length
        self._grammar_limits = (grammar_max_bytes, grammar_timeout)
        self._grammars: GrammarChecker | None = None
        self._token_str: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}

    def __repr__(self) -> str:
        return f"ServedModel({self.name!r}, kind={self.kind!r}, aliases={self.aliases!r})"

    # ------------------------------------------------------------------ names and card
    @property
    def name(self) -> str:
        """The served name ("" for a flag-declared default model before its first card)."""
        if self._name is not None:
            return self._name
        card = self.pool.card if self.pool is not None else None
        return card.name if card is not None else ""

    @property
    def named_by_card(self) -> bool:
        """True for the default model of the single-model flags: its served name is its card's."""
        return self._name is None

    @property
    def declared_names(self) -> tuple[str, ...]:
        """The names fixed at declaration: the served name (unless named by the card), then the aliases."""
        return tuple(n for n in (self._name, *self.aliases) if n)

    @property
    def names(self) -> tuple[str, ...]:
        """The served name, then the aliases (no empty name, no repeat)."""
        out: list[str] = []
        for n in (self.name, *self.aliases):
            if n and n not in out:
                out.append(n)
        return tuple(out)

    @property
    def card_or_none(self) -> ModelCard | None:
        """The backends' model card (the last one seen), or None (not ready yet, or not native)."""
        return self.pool.card if self.pool is not None else None

    @property
    def card(self) -> ModelCard:
        """The backends' model card. Raises ``ServiceUnavailable`` (503) while none is known (or for a
        model without backends)."""
        card = self.card_or_none
        if card is None:
            raise ServiceUnavailable(f"No inference backend of the model '{self.name}' is ready yet.")
        return card

    @property
    def context_length(self) -> int:
        """Tokens a request may use: the declared ``context_length``, else the card's. Raises
        ``ServiceUnavailable`` (503) when neither is known."""
        if self._context_length is not None:
            return self._context_length
        return self.card.context_length

    @property
    def vocab_size(self) -> int:
        """The vocabulary size: the card's, else the tokenizer's (0 when neither is known)."""
        card = self.card_or_none
        if card is not None and card.vocab_size:
            return card.vocab_size
        return self.tokenizer.vocab_size if self.tokenizer is not None else 0

    def is_ready(self) -> bool:
        """A native model: a backend is ready and its pool is not draining; another kind: always."""
        return self.pool.is_ready() if self.pool is not None else True

    # ------------------------------------------------------------------ text side
    def text(self) -> tuple[TextTokenizer, ChatTemplate]:
        """This model's tokenizer and chat template. Raises ``ServiceUnavailable`` (503) for a model
        without them (an upstream that tokenizes itself is served by its own route)."""
        if self.tokenizer is None or self.template is None:
            raise ServiceUnavailable(f"The model '{self.name}' has no tokenizer in this gateway.")
        return self.tokenizer, self.template

    @property
    def grammars(self) -> GrammarChecker:
        """The grammar checker over this model's vocabulary (made on first use). Raises
        ``ServiceUnavailable`` as ``text()``."""
        if self._grammars is None:
            tok, _ = self.text()
            max_bytes, timeout = self._grammar_limits
            self._grammars = GrammarChecker(
                tok.tokenizer.to_str,
                tok.vocab_size,
                sorted(tok.stop_token_ids),
                max_bytes=max_bytes,
                timeout=timeout,
            )
        return self._grammars

    async def close_grammars(self) -> None:
        """Stop the grammar checker's idle worker processes, if it was made."""
        if self._grammars is not None:
            await self._grammars.aclose()

    def token_str(self, tid: int) -> str:
        """Printable text of one token of this model (its bytes decoded with U+FFFD for partial UTF-8),
        cached."""
        s = self._token_str.get(tid)
        if s is None:
            tok, _ = self.text()
            s = self._token_str[tid] = tok.id_to_bytes[tid].decode("utf-8", errors="replace")
        return s

    def token_bytes(self, tid: int) -> list[int]:
        """The raw bytes of one token of this model, as a list of ints (OpenAI logprobs ``bytes``), cached
        (callers only encode it)."""
        b = self._token_bytes.get(tid)
        if b is None:
            tok, _ = self.text()
            b = self._token_bytes[tid] = list(tok.id_to_bytes[tid])
        return b


class ModelCatalog:
    """Every served model, the first the default. Names are unique across models (checked here).

    Args:
        models: the served models, in declaration order (at least one).

    Raises:
        ValueError: no model, or one name (served name or alias) used by two models.
    """

    def __init__(self, models: list[ServedModel]) -> None:
        if not models:
            raise ValueError("the catalog needs at least one model")
        self.models = list(models)
        self._draining = False
        seen: dict[str, str] = {}
        for m in self.models:
            for n in m.names:
                if n in seen and seen[n] != m.name:
                    raise ValueError(f"the model name {n!r} is used by both {seen[n]!r} and {m.name!r}")
                seen[n] = m.name
        self._fixed: dict[str, ServedModel] = {}  # declared names and aliases -> model (a dict lookup)
        for m in self.models:
            for n in m.declared_names:
                self._fixed.setdefault(n, m)
        self._named_by_card = [m for m in self.models if m.named_by_card]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    @property
    def default(self) -> ServedModel:
        """The first model declared (the one the single-model flags declare)."""
        return self.models[0]

    @property
    def pools(self) -> list[BackendPool]:
        """The native models' backend pools, in declaration order."""
        return [m.pool for m in self.models if m.pool is not None]

    def find(self, model: str) -> ServedModel | None:
        """The model with served name or alias ``model`` (exact, case-sensitive), or None."""
        m = self._fixed.get(model)
        if m is not None:
            return m
        for m in self._named_by_card:  # the default model of the single-model flags: its card's name
            if m.name == model:
                return m
        return None

    def resolve(self, model: str, principal: Principal | None) -> ServedModel:
        """The model a request's ``model`` names, when ``principal`` may use it (None: no tenancy, any).

        Raises:
            NotFound: 404 ``model_not_found`` (param ``model``) for a name no model has, and for a model the
                tenant may not use (``Principal.allows_model`` over all its names): the same message, which
                lists only the models that tenant may use.
        """
        m = self.find(model)
        if m is not None and (principal is None or principal.allows_model(*m.names)):
            return m
        names = [n for _, n in self.listing(principal)]
        shown = model if len(model) <= 200 else model[:200] + "..."
        raise NotFound(
            f"The model '{shown}' does not exist. Available: {', '.join(names) or 'none'}.",
            param="model",
            code="model_not_found",
        )

    def list(self, principal: Principal | None) -> list[ServedModel]:
        """The models ``principal`` may use (None: every model), in declaration order."""
        return [m for m in self.models if principal is None or principal.allows_model(*m.names)]

    def listing(self, principal: Principal | None) -> list[tuple[ServedModel, str]]:
        """``(model, name)`` for every name (served name, then aliases) of every model ``principal`` may
        use: the entries of ``GET /v1/models`` and ``GET /api/tags``."""
        return [(m, n) for m in self.list(principal) for n in m.names]

    # ------------------------------------------------------------------ readiness and shutdown
    def is_ready(self) -> bool:
        """Every native model has a ready backend (and none is draining)."""
        return all(m.is_ready() for m in self.models)

    @property
    def draining(self) -> bool:
        """True once the gateway drains (set on SIGINT/SIGTERM; every pool's flag is set with it)."""
        return self._draining or any(p.draining for p in self.pools)

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        for p in self.pools:
            p.draining = value

    async def aclose(self) -> None:
        """Close every upstream model (``UpstreamModel.aclose``), one after another; backend pools are
        stopped by the server (``BackendPool.stop``); then each model's grammar check workers."""
        for m in self.models:
            if m.upstream is not None:
                await m.upstream.aclose()
        for m in self.models:
            await m.close_grammars()
