"""Chat templating: OpenAI ``messages`` -> the model's prompt text and prompt token ids.

Sources followed:

* Hugging Face chat templating (``transformers`` ``apply_chat_template`` / ``utils/chat_template_utils.py``):
  a sandboxed Jinja2 environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``,
  ``loopcontrols``), globals ``raise_exception`` and ``strftime_now``, a ``tojson`` filter that does not
  escape HTML or non-ASCII, the context ``messages``, ``tools``, ``add_generation_prompt`` and the
  tokenizer's ``bos_token``/``eos_token``; ``continue_final_message`` cuts the rendered prompt right after the
  final message's content (trailing whitespace stripped), and is an error together with
  ``add_generation_prompt``.
* OpenAI Chat Completions API reference (``messages[].content`` is a string, null for an assistant with
  ``tool_calls``, or an array of content parts).

Errors are ``templating.errors.TemplateError`` subclasses carrying OpenAI's ``message``/``param``/``code``
(the gateway answers them with a 400 ``invalid_request_error``).

Rules of this gateway (documented in ``docs/text.md``):

* Text parts of one message are joined in order with ``TEXT_PART_SEPARATOR`` (``"\\n"``, vLLM's choice);
  an assistant's ``refusal`` parts count as text.
  A part of any other type (``image_url``, ``input_audio``, ``file``...) is an ``InvalidConversation``
  naming ``messages[i].content[j].type``.
* Consecutive messages with the same role are NOT merged: each renders as its own block (ChatML does this).
* Roles are OpenAI's: ``system``, ``developer``, ``user``, ``assistant``, ``tool`` and the legacy
  ``function``; any other role is an ``InvalidConversation`` naming ``messages[i].role``. ``developer`` (newer OpenAI role) is
  rendered as ``system``.
* Control tokens: only the special tokens the template itself writes become special ids. Every string that
  comes from the client (contents, names, roles, tool calls, tool definitions) is encoded as literal text
  even when it spells ``<|im_end|>``: before rendering, each special-token string inside client strings
  (and a partial one at either end of a client string) is swapped for a random private-use placeholder; after rendering, special tokens are found only in what the
  template wrote, and the placeholders are turned back into the literal text, which is tokenized as
  ordinary text. Token boundaries are the ones HF gives for the same text (text between special tokens is
  tokenized as one piece), so honest prompts get exactly HF's ids.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from templating.errors import InvalidConversation, TemplateRejected
from templating.tokenizer import TextTokenizer

__all__ = ["ChatTemplate", "ChatPrompt", "normalize_messages", "TEXT_PART_SEPARATOR"]

#: Separator placed between the text parts of one message's ``content`` array.
TEXT_PART_SEPARATOR = "\n"

log = logging.getLogger("gateway.templating")

_ROLE_ALIASES = {"developer": "system"}
#: The roles OpenAI's Chat Completions API accepts (``function`` is the legacy form of ``tool``).
VALID_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Roles whose content may be null/missing (OpenAI: assistant with tool_calls / function_call).
_NULL_CONTENT_ROLES = {"assistant"}


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered prompt.

    Attributes:
        text: the prompt text exactly as the template rendered it (control-token strings from the client
            appear literally).
        ids: its token ids (int), special ids only where the template put a special token.
    """

    text: str
    ids: list[int]


# ---------------------------------------------------------------------------------------------------
# Jinja environment (HF semantics)
# ---------------------------------------------------------------------------------------------------


class _TemplateRaised(Exception):
    """Raised by ``raise_exception`` inside a template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # HF: "We override the built-in tojson filter because Jinja's default filter escapes HTML characters".
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):  # type: ignore[override]
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---------------------------------------------------------------------------------------------------
# Message validation / normalization
# ---------------------------------------------------------------------------------------------------


def _content_to_text(content: Any, param: str, role: str = "user") -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        if not content:
            raise InvalidConversation(f"'{param}' must not be an empty array.", param=param)
        texts: list[str] = []
        for j, part in enumerate(content):
            pp = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise InvalidConversation(f"'{pp}' must be an object.", param=pp)
            ptype = part.get("type")
            if ptype == "refusal" and role == "assistant":  # OpenAI assistant content part
                refusal = part.get("refusal")
                if not isinstance(refusal, str):
                    raise InvalidConversation(f"'{pp}.refusal' must be a string.", param=f"{pp}.refusal")
                texts.append(refusal)
                continue
            if ptype != "text":
                if not isinstance(ptype, str):
                    raise InvalidConversation(
                        f"'{pp}.type' is required and must be a string.", param=f"{pp}.type"
                    )
                raise InvalidConversation(
                    f"'{pp}.type' is {ptype!r}: this model accepts only 'text' content parts.",
                    param=f"{pp}.type",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidConversation(
                    f"'{pp}.text' is required and must be a string.", param=f"{pp}.text"
                )
            texts.append(text)
        return TEXT_PART_SEPARATOR.join(texts)
    raise InvalidConversation(f"'{param}' must be a string or an array of content parts.", param=param)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI ``messages`` and return copies whose ``content`` is a ``str`` (or None).

    Content arrays are joined with ``TEXT_PART_SEPARATOR``; ``developer`` becomes ``system``; other keys
    (``name``, ``tool_calls``, ``tool_call_id``...) are kept as given.

    Raises:
        InvalidConversation: ``messages`` not a non-empty array (param ``messages``); a message not an object
            (``messages[i]``); ``role`` missing, not a string or not one of ``VALID_ROLES``
            (``messages[i].role``, code ``invalid_value`` for an unknown role); content
            missing/null for a non-assistant message or of the wrong type (``messages[i].content``); a
            non-text part (``messages[i].content[j].type``); a part without string text
            (``messages[i].content[j].text``).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidConversation("'messages' must be a non-empty array.", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidConversation(f"'{p}' must be an object.", param=p)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidConversation(
                f"'{p}.role' is required and must be a non-empty string.", param=f"{p}.role"
            )
        if role not in VALID_ROLES:
            raise InvalidConversation(
                f"Invalid value for '{p}.role': {role[:64]!r}. Supported values are: {', '.join(repr(r) for r in VALID_ROLES)}.",
                param=f"{p}.role",
                code="invalid_value",
            )
        role = _ROLE_ALIASES.get(role, role)
        content = m.get("content")
        if content is None:
            if role not in _NULL_CONTENT_ROLES:
                raise InvalidConversation(
                    f"'{p}.content' is required for role {role!r}.", param=f"{p}.content"
                )
            # OpenAI allows a null assistant content with tool_calls; without them it is an empty message.
            text = None if m.get("tool_calls") or m.get("function_call") else ""
        else:
            text = _content_to_text(content, f"{p}.content", role)
        nm = dict(m)
        nm["role"] = role
        nm["content"] = text
        out.append(nm)
    return out


# ---------------------------------------------------------------------------------------------------
# Control-token neutralization
# ---------------------------------------------------------------------------------------------------


class _Specials:
    """The special-token strings of a tokenizer, with what neutralization needs (built once per template)."""

    def __init__(self, specials: Sequence[str]):
        self.tokens = sorted(set(specials), key=len, reverse=True)
        self.pattern = re.compile("|".join(re.escape(s) for s in self.tokens)) if self.tokens else None
        self.max_len = max((len(s) for s in self.tokens), default=0)
        self.prefixes = frozenset(s[:k] for s in self.tokens for k in range(1, len(s)))
        self.suffixes = frozenset(s[k:] for s in self.tokens for k in range(1, len(s)))


class _Neutralizer:
    """Per request: swaps control-token text in client strings for private-use placeholders, and back.

    Replaced: every full special-token string, and a proper prefix of one at the very end of a client string
    (or a proper suffix at its very start), so that no special token can form across the boundary between
    client text and template text either. ``restore`` puts the original characters back exactly.
    """

    def __init__(self, specials: _Specials):
        self.sp = specials
        # 6 random private-use characters (U+E000..U+F8FF): ~2^75 choices, not guessable by a client.
        nonce = "".join(chr(0xE000 + secrets.randbelow(0x1900)) for _ in range(6))
        self.open = "\U000f0000" + nonce
        self.close = "\U000f0001"
        self.literals: list[str] = []

    def _ph(self, literal: str) -> str:
        self.literals.append(literal)
        return f"{self.open}{len(self.literals) - 1}{self.close}"

    def _str(self, x: str) -> str:
        sp = self.sp
        if any(t in x for t in sp.tokens):
            x = sp.pattern.sub(lambda m: self._ph(m.group(0)), x)
        lim = min(sp.max_len - 1, len(x))
        tail = next((k for k in range(lim, 0, -1) if x[-k:] in sp.prefixes), 0)
        lim = min(sp.max_len - 1, len(x) - tail)
        head = next((k for k in range(lim, 0, -1) if x[:k] in sp.suffixes), 0)
        if tail:
            x = x[:-tail] + self._ph(x[-tail:])
        if head:
            x = self._ph(x[:head]) + x[head:]
        return x

    def apply(self, x: Any) -> Any:
        if self.sp.pattern is None:
            return x
        if isinstance(x, str):
            return self._str(x)
        if isinstance(x, dict):
            return {self.apply(k): self.apply(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [self.apply(v) for v in x]
        return x

    def restore(self, text: str) -> str:
        if not self.literals:
            return text
        back = re.compile(re.escape(self.open) + r"(\d+)" + re.escape(self.close))  # only when used
        return back.sub(lambda m: self.literals[int(m.group(1))], text)


# ---------------------------------------------------------------------------------------------------
# The template
# ---------------------------------------------------------------------------------------------------


class ChatTemplate:
    """The model's chat template bound to its tokenizer. Build once at startup; ``render`` per request.

    Args:
        tokenizer: the model's ``TextTokenizer``.
        source: Jinja source; default ``tokenizer.chat_template``.

    Raises:
        ValueError: no template available.
        jinja2.TemplateSyntaxError: the template does not compile.
    """

    def __init__(self, tokenizer: TextTokenizer, source: str | None = None):
        source = source if source is not None else tokenizer.chat_template
        if not source:
            raise ValueError("the model has no chat template")
        self.tokenizer = tokenizer
        self.source = source
        self._template = _compile(source)
        self._specials = _Specials(tokenizer.special_tokens.values())
        self._special_re = self._specials.pattern
        self._special_id = {s: i for i, s in tokenizer.special_tokens.items()}
        #: True if the template mentions ``tools`` (otherwise tool definitions do not reach the prompt).
        self.supports_tools = "tools" in source
        #: True if the template mentions ``tool_calls`` (otherwise an assistant's tool calls are not rendered,
        #: and one with null content cannot be: 400).
        self.supports_tool_calls = "tool_calls" in source

    def render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        extra_context: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        """Render and tokenize a conversation.

        Args:
            messages: OpenAI ``messages`` (validated by ``normalize_messages``).
            add_generation_prompt: append the assistant header (``<|im_start|>assistant\\n``).
            continue_final_message: the final message must be the assistant's; the prompt ends with its
                content (trailing whitespace stripped, HF semantics) with no end marker and no new header,
                so generation continues that text.
            tools: OpenAI ``tools`` list passed to the template as ``tools`` (ignored by templates that do
                not use it; see ``supports_tools``).
            extra_context: more template variables (e.g. ``documents``); cannot override the ones above.

        Returns:
            ChatPrompt(text, ids).

        Raises:
            InvalidConversation: bad messages (see ``normalize_messages``); both flags true
                (param ``continue_final_message``); continue_final_message with a final message that is not
                the assistant's (``messages[i].role``); ``tools`` not a list of objects (param ``tools``); an
                assistant message with null content (it has ``tool_calls``) when the template does not render
                ``tool_calls`` (``messages[i].content``, code ``unsupported_value``).
            TemplateRejected: the template raised or failed on this input (param ``messages``, code
                ``invalid_value`` for a failure; the message names no Python exception), or it does not
                render the final message's content that continue_final_message continues (param
                ``messages``).
        """
        if continue_final_message and add_generation_prompt:
            raise InvalidConversation(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                param="continue_final_message",
            )
        msgs = normalize_messages(messages)
        if not self.supports_tool_calls:
            for i, m in enumerate(msgs):
                if m["content"] is None:  # an assistant with tool_calls/function_call and null content
                    raise InvalidConversation(
                        f"'messages[{i}].content' is null, but this model's chat template does not render 'tool_calls': "
                        "give the assistant message a text content.",
                        param=f"messages[{i}].content",
                        code="unsupported_value",
                    )
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise InvalidConversation("'tools' must be an array of objects.", param="tools")

        neut = _Neutralizer(self._specials)
        msgs = neut.apply(msgs)
        tools_n = neut.apply(tools) if tools is not None else None

        marker = None
        if continue_final_message:
            last = msgs[-1]
            if last["role"] != "assistant":
                raise InvalidConversation(
                    "'continue_final_message' needs the final message to be from the assistant.",
                    param=f"messages[{len(msgs) - 1}].role",
                )
            marker = "\U000f0002" + secrets.token_hex(8) + "\U000f0003"
            final = (last.get("content") or "").rstrip()
            msgs[-1] = dict(last, content=final + marker)

        ctx = dict(extra_context or {})
        ctx.update(
            messages=msgs,
            tools=tools_n,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.bos_token,
            eos_token=self.tokenizer.eos_token,
        )
        try:
            text = self._template.render(**ctx)
        except _TemplateRaised as e:
            raise TemplateRejected(
                f"The chat template rejected the messages: {e}", param="messages"
            ) from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            log.info("chat template failed on a request: %s", type(e).__name__)  # internals stay in the log
            raise TemplateRejected(
                "The model's chat template could not render these messages (a field is missing or of a type it "
                "does not accept).",
                param="messages",
                code="invalid_value",
            ) from None

        if marker is not None:
            cut = text.rfind(marker)
            if cut < 0:
                raise TemplateRejected(
                    "'continue_final_message': the chat template does not render the final message's content.",
                    param="messages",
                )
            text = text[:cut]

        return ChatPrompt(text=neut.restore(text), ids=self._tokenize(text, neut))

    def _tokenize(self, text: str, neut: _Neutralizer) -> list[int]:
        """Special ids for the special-token strings in ``text`` (all written by the template, since client
        strings carry placeholders instead), ordinary tokens for each piece between them."""
        tok = self.tokenizer
        if self._special_re is None:
            return tok.encode_plain(neut.restore(text))
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                ids.extend(tok.encode_plain(neut.restore(text[pos : m.start()])))
            ids.append(self._special_id[m.group(0)])
            pos = m.end()
        if pos < len(text):
            ids.extend(tok.encode_plain(neut.restore(text[pos:])))
        return ids
