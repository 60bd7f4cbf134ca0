"""The Jinja2 environment chat templates run in: Hugging Face ``transformers`` semantics, sandboxed.

Source followed: ``transformers`` ``utils/chat_template_utils.py`` (``_cached_compile_jinja_template``,
checked against 5.24):

* ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols``
  extension (``{% break %}``, ``{% continue %}``) and the ``{% generation %}...{% endgeneration %}`` tag
  (HF's assistant-mask marker; here it renders its body unchanged);
* globals ``raise_exception(message)`` (the template refuses the input), ``strftime_now(format)``
  (``datetime.now().strftime``, local time; Llama 3's ``date_string`` comes from it), ``dict`` (a
  constructor only: no attribute of the ``dict`` type is reachable) and ``namespace`` (refuses
  underscore-prefixed attribute names);
* the ``tojson`` filter is ``json.dumps(x, ensure_ascii=False, indent=None, separators=None,
  sort_keys=False)``: no HTML escaping, non-ASCII kept, HF's keyword arguments accepted.

Errors a template can cause while rendering are described for the client by :func:`describe_failure`,
which names the template feature at fault (the filter, the value it read, the operation) and no Python
exception class.

::

    Exception
     └── TemplateRaised          raise_exception() was called by the template (its message is the template's)
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateRaised", "compile_template", "describe_failure", "RENDER_ERRORS"]

#: What rendering a template can raise on bad input besides :class:`TemplateRaised` (all caught, never a 500).
RENDER_ERRORS = (
    jinja2.TemplateError,
    TypeError,
    ValueError,
    KeyError,
    IndexError,
    AttributeError,
    ArithmeticError,
    RecursionError,
)

_UNKNOWN = re.compile(r"No (filter|test) named '([^']*)'")  # Jinja's runtime error for an unknown name
_DETAIL_CHARS = 160  # how much of an error's own text reaches the client


class TemplateRaised(Exception):
    """Raised by ``raise_exception(message)`` inside a template; ``str(exc)`` is the template's message."""


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF: Jinja's own tojson escapes HTML characters; this one does not, and takes json.dumps's options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, and nothing else of the ``dict`` type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed attributes (no path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick (namespace(self=1))
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace attribute may not start with an underscore ({name[:40]!r})"
            )


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):  # type: ignore[override]
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (memoized by source: templates are immutable and shared between requests).

    Raises:
        jinja2.TemplateSyntaxError: the source does not parse.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _clip(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS - 3] + "..."


def describe_failure(exc: BaseException) -> str:
    """One sentence for the client naming the template feature that failed on a request's input.

    Args:
        exc: one of :data:`RENDER_ERRORS` raised while rendering.

    Returns:
        e.g. ``"it uses the filter 'from_json', which chat templates do not have"``,
        ``"it reads a value the conversation does not have ('dict object' has no attribute 'content')"``,
        ``"it attempted an operation the sandbox forbids (access to attribute 'append' of 'list' object is
        unsafe.)"``; the text quoted from the error is cut to 160 characters.
    """
    msg = str(exc)
    if isinstance(exc, jinja2.UndefinedError):
        return f"it reads a value the conversation does not have ({_clip(msg)})"
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return f"it attempted an operation the sandbox forbids ({_clip(msg)})"
    if isinstance(exc, jinja2.TemplateError):
        unknown = _UNKNOWN.match(msg)
        if unknown:
            return f"it uses the {unknown[1]} {_clip(unknown[2])!r}, which chat templates do not have"
        return f"it failed: {_clip(msg)}"
    if isinstance(exc, RecursionError):
        return "it recursed too deeply"
    if isinstance(exc, (KeyError, IndexError)):
        return f"it looks up a key or index the conversation does not have ({_clip(msg)})"
    return f"it applied an operation to a value of a type it does not accept ({_clip(msg)})"
