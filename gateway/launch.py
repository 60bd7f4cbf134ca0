"""The served models of a starting gateway: each declared model (``gateway.sections.ModelSettings``, or the
single-model options) made into a ``gateway.catalog.ServedModel`` once its backends are ready.

A native model's tokenizer comes from its ``tokenizer``, else its ``path``, else (remote backends) the
backend card's ``model_path``, else the default model; its chat template from its ``chat_template`` file,
else the card's, else the tokenizer's. Two models with the same tokenizer source share one load
(``templating.cached_tokenizer``) and, with the same template source too, one compiled ``ChatTemplate``. A
model of kind ``openai`` is opened by ``gateway.upstream`` (its ``[[models]]`` keys beyond the common ones,
``ModelSettings.upstream``).

Errors: ``StartupError`` (``str()`` one line naming the model, the path and the reason): a tokenizer or
template that cannot be loaded, a ``context_length`` over the backend's, an upstream model that cannot be
opened (or a build without ``gateway.upstream``).
"""

from __future__ import annotations

import jinja2
import msgspec
import trio

from gateway.backends.pool import BackendPool
from gateway.catalog import ServedModel, UpstreamModel
from gateway.sections import ModelSettings, Settings
from templating import ChatTemplate, TextTokenizer, cached_tokenizer

_TEMPLATES: dict[tuple[str | None, str | None], ChatTemplate] = {}


class StartupError(Exception):
    """The gateway cannot start; ``str()`` is the one-line reason (``cannot load tokenizer PATH: REASON``)."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _load_tokenizer(path: str | None) -> TextTokenizer:
    """``cached_tokenizer(path)``. Raises ``StartupError`` naming the path and the reason."""
    try:
        return cached_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizer's loader raises: one line, exit 1
        raise StartupError(f"cannot load tokenizer {path}: {_one_line(exc)}") from None


def _chat_template(tokenizer: TextTokenizer, source: str | None, key: str | None = None) -> ChatTemplate:
    """``ChatTemplate(tokenizer, source)``, shared by the models whose tokenizer source ``key`` and template
    source are the same. Raises ``StartupError`` when the model has no usable template (none given and none
    in the tokenizer's files, or one that does not compile)."""
    cached = _TEMPLATES.get((key, source)) if key is not None else None
    if cached is not None and cached.tokenizer is tokenizer:
        return cached
    try:
        template = ChatTemplate(tokenizer, source)
    except (ValueError, jinja2.TemplateError) as exc:
        raise StartupError(f"cannot use the model's chat template: {_one_line(exc)}") from None
    if key is not None:
        _TEMPLATES[(key, source)] = template
    return template


def _template_file(model: ModelSettings) -> str | None:
    """The text of the model's ``chat_template`` file (None: none given). Raises ``StartupError``."""
    if model.chat_template is None:
        return None
    try:
        with open(model.chat_template, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else _one_line(exc)
        raise StartupError(
            f"model {model.name!r}: cannot read chat_template {model.chat_template}: {reason}"
        ) from None


async def _upstream(model: ModelSettings) -> UpstreamModel:
    """The ``openai`` model's upstream (``gateway.upstream.model.open_upstream``) from its ``upstream`` keys,
    ``tokenizer`` and ``context_length``. Raises ``StartupError`` (a bad key or value, an upstream that
    cannot be opened, a build without the module)."""
    try:  # imported here: only a gateway serving such a model loads its HTTP client
        from gateway.upstream.config import UpstreamConfig
        from gateway.upstream.model import open_upstream
    except ImportError:
        raise StartupError(
            f"model {model.name!r}: kind {model.kind!r} is not available in this build"
        ) from None
    fields = dict(model.upstream)
    if model.tokenizer is not None:
        fields["tokenizer"] = model.tokenizer
    if model.context_length is not None:
        fields["context_length"] = model.context_length
    try:
        config = msgspec.convert(fields, UpstreamConfig)
        return await open_upstream(model.name, config, tuple(model.aliases))
    except (msgspec.ValidationError, ValueError) as exc:
        raise StartupError(f"model {model.name!r}: {_one_line(exc)}") from None


async def served_model(
    settings: Settings, declared: ModelSettings | None, pool: BackendPool | None, default_path: str | None
) -> ServedModel:
    """The ``ServedModel`` of one declared model (None: the default model of the single-model options),
    after its backends' first ``Ready`` (``pool``; None for a model of another kind). ``default_path``: the
    default model file. Raises ``StartupError`` (see the module docstring)."""
    http = settings.http
    limits = {"grammar_max_bytes": http.grammar_max_bytes, "grammar_timeout": http.grammar_timeout}
    if declared is not None and declared.kind != "native":
        upstream = await _upstream(declared)
        return ServedModel(
            declared.name,
            kind=declared.kind,  # type: ignore[arg-type]  # checked by ModelSettings
            aliases=declared.aliases,
            upstream=upstream,
            context_length=upstream.context_length,
            **limits,  # type: ignore[arg-type]
        )
    card = pool.card if pool is not None else None
    if declared is None:
        tok_path = settings.backend.tokenizer or default_path or (card.model_path if card else None)
        source = None
    else:
        remote = card.model_path if declared.backend_url and card is not None else None
        tok_path = declared.tokenizer or declared.path or remote or default_path
        source = _template_file(declared)
    tokenizer = await trio.to_thread.run_sync(_load_tokenizer, tok_path)
    if source is None and card is not None and card.chat_template:
        source = card.chat_template
    template = _chat_template(tokenizer, source, tok_path)
    context_length = declared.context_length if declared is not None else None
    if context_length is not None and card is not None and context_length > card.context_length:
        raise StartupError(
            f"model {declared.name!r}: context_length {context_length} is over its backend's "  # type: ignore[union-attr]
            f"{card.context_length} tokens"
        )
    return ServedModel(
        declared.name if declared is not None else None,
        pool=pool,
        aliases=declared.aliases if declared is not None else http.served_model_name,
        tokenizer=tokenizer,
        template=template,
        context_length=context_length,
        **limits,  # type: ignore[arg-type]
    )
