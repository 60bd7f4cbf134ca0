"""How large a request's prompt is before it is rendered: what decides templating in a worker thread
(``rendered_chars``: every rendered string, tools and tool calls included) and the cheap refusal of a
prompt that cannot fit the context (``prompt_floor`` against ``check_fits``), both without templating,
tokenizing or recursion (gateway/openai/prepare.py calls them; docs/gateway.md "Templating + tokenizing").
"""

from __future__ import annotations

import math

from gateway.errors import ContextLengthExceeded

#: Characters counted for each message, object and array of a request's rendered part (the template's
#: role header and markers, a JSON key's quotes): many empty members are work too.
NODE_CHARS = 16

#: Names whose string values are never rendered as given (a content part's ``type``), or rendered by some
#: templates only (earlier turns' reasoning): left out of ``prompt_floor``.
_UNRENDERED = frozenset({"type", "reasoning_content", "thinking", "reasoning", "role"})


def _string_chars(
    values: list[object], *, node: int, keys: bool, skip: frozenset[str], stop_after: float
) -> int:
    """Characters of the strings in ``values`` (dict keys too when ``keys``; members named in ``skip`` left
    out), plus ``node`` per object and array. Iterative (nesting depth costs no stack); returns as soon as
    the count passes ``stop_after``."""
    n = 0
    todo = list(values)
    while todo and n <= stop_after:
        x = todo.pop()
        if isinstance(x, str):
            n += len(x)
        elif isinstance(x, dict):
            n += node
            for k, v in x.items():
                if k not in skip:
                    n += len(k) if keys and isinstance(k, str) else 0
                    todo.append(v)
        elif isinstance(x, (list, tuple)):
            n += node
            todo.extend(x)
    return n


def rendered_chars(messages: object, tools: object = None, *, stop_after: int | None = None) -> int:
    """Size of what the chat template renders, in characters: every string (keys and values) of
    ``messages`` and ``tools``, plus ``NODE_CHARS`` per message, object and array (decides inline vs
    threaded templating and tokenizing: a 3.9 MB tool description or 1 MB of tool-call arguments is as
    much work as a long message).

    ``stop_after``: return as soon as the count passes it (the caller only asks "more than this?", so the
    walk on the event loop stays bounded by ``stop_after``, not by the request)."""
    limit = math.inf if stop_after is None else stop_after
    return _string_chars([messages, tools], node=NODE_CHARS, keys=True, skip=frozenset(), stop_after=limit)


def prompt_floor(messages: object, tools: object = None) -> int:
    """Characters of the request that every chat template renders as given: the string values of
    ``messages`` and ``tools`` (contents, text parts, tool calls and their arguments, tool definitions),
    keys and the members named in ``_UNRENDERED`` left out. A lower bound of the rendered text's length;
    each token stands for at most ``TextTokenizer.max_token_bytes`` of its bytes (a character is one or
    more), so the prompt has at least ``prompt_floor / max_token_bytes`` tokens (``check_fits``)."""
    return _string_chars([messages, tools], node=0, keys=False, skip=_UNRENDERED, stop_after=math.inf)


#: Safety factor of the cheap bound: a prompt is refused before it is rendered only when even half its
#: characters could not fit (a normalizer that shortens text, a template that trims it).
FLOOR_FACTOR = 2


def check_fits(chars: int, max_token_bytes: int, context_length: int, *, param: str = "messages") -> None:
    """Refuse, before rendering or tokenizing, a prompt of ``chars`` characters (a lower bound of what is
    rendered: ``prompt_floor``, or a raw prompt's length) that cannot fit ``context_length`` tokens: it has
    at least ``chars / (FLOOR_FACTOR * max_token_bytes)`` tokens. A prompt that passes is counted exactly
    after tokenizing (``resolve_max_tokens``).

    Raises:
        ContextLengthExceeded: 400 ``context_length_exceeded`` naming ``param``.
    """
    least = chars // (FLOOR_FACTOR * max(1, max_token_bytes))
    if least >= context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, your prompt has "
            f"{chars} characters, at least {least} tokens, and leaves no room for a completion. Please "
            "shorten the prompt.",
            param=param,
        )
