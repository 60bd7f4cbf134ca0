"""Chat templating: OpenAI ``messages`` -> the model's prompt text and prompt token ids.

Sources followed:

* Hugging Face chat templating (``transformers`` ``apply_chat_template`` / ``utils/chat_template_utils.py``,
  checked against 5.24 on the 70 templates llama.cpp ships: ``tests/unit/templating/test_template_corpus.py``):
  the sandboxed environment and its helpers are ``templating.jinja_env``; the context is ``messages`` (keys
  whose value is null dropped; ``reasoning_content``/``thinking``/``reasoning`` aliased to each other),
  ``tools`` (JSON-schema dicts, or None), ``documents`` (None unless given), ``add_generation_prompt`` and
  the tokenizer's ``bos_token``/``eos_token``/``unk_token``/``pad_token`` (those it has);
  ``continue_final_message`` cuts the rendered prompt right after the final message's content (its
  trailing whitespace kept where the template keeps it, else stripped), and is an error together with
  ``add_generation_prompt``.
* vLLM: an assistant's ``tool_calls[].function.arguments`` given as a JSON-object string (OpenAI's wire
  form) reaches the template as that object (HF's convention: templates call ``arguments.items()``).
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
  tokenized as one piece, the whitespace next to a token with a strip flag dropped as llama.cpp drops it),
  so honest prompts get exactly HF's ids.
* BOS: the ids start with exactly one. A template that writes ``bos_token`` gives it (HF); otherwise it is
  added when the tokenizer's metadata says so (``add_bos_token``: llama.cpp's chat path). EOS is never
  added to a chat prompt.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from templating.errors import InvalidConversation, TemplateRejected
from templating.jinja_env import RENDER_ERRORS, TemplateRaised, compile_template, describe_failure
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
#: The characters C's ``isspace`` accepts: the whitespace llama.cpp strips next to an lstrip/rstrip token.
_C_SPACE = " \t\n\v\f\r"


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered prompt.

    Attributes:
        text: the prompt text exactly as the template rendered it (control-token strings from the client
            appear literally).
        ids: its token ids (int), special ids only where the template put a special token, and BOS first
            when the tokenizer adds one (``add_bos_token``) and the template did not write it (then ``text``
            does not show it).
    """

    text: str
    ids: list[int]


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


#: Names a message's reasoning may come under; HF fills ``reasoning_content`` (the one templates read) and
#: ``thinking`` (gpt-oss templates) from the first one present (``_alias_reasoning_fields``).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _tool_call_arguments(call: Any) -> Any:
    """A tool call with ``function.arguments`` given as a JSON-object string (OpenAI's wire form) turned into
    that object (the form HF templates read: ``arguments.items()``, ``arguments | tojson``; vLLM does the
    same). Any other value, or a string that is not a JSON object, is kept as given."""
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except (ValueError, RecursionError):
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**fn, "arguments": parsed}}


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A normalized message as HF hands it to the template: keys whose value is None dropped
    (``_normalize_chat_messages``: templates test a missing key, not a null one), reasoning aliased
    (``_alias_reasoning_fields``), tool-call arguments as objects (``_tool_call_arguments``). A new dict;
    ``m`` is not changed."""
    out = {k: v for k, v in m.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_tool_call_arguments(c) for c in out["tool_calls"]]
    return out


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
        self._template = compile_template(source)
        self._specials = _Specials(tokenizer.special_tokens.values())
        self._special_re = self._specials.pattern
        self._special_id = {s: i for i, s in tokenizer.special_tokens.items()}
        # HF passes the tokenizer's special_tokens_map: only the tokens it has (a missing one is undefined).
        self._token_vars: dict[str, str] = {}
        for name, tid in (
            ("bos_token", tokenizer.bos_token_id),
            ("eos_token", tokenizer.eos_token_id),
            ("unk_token", tokenizer.unk_token_id),
            ("pad_token", tokenizer.pad_token_id),
        ):
            text = tokenizer.id_to_token(tid) if tid is not None else None
            if text:
                self._token_vars[name] = text
        #: True if the template mentions ``tools`` (otherwise tool definitions do not reach the prompt).
        self.supports_tools = "tools" in source
        #: True if the template mentions ``tool_calls`` (otherwise an assistant's tool calls are not rendered,
        #: and a template that needs every message's content cannot render one with null content: 400).
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
        """Render and tokenize a conversation (HF ``apply_chat_template(..., tokenize=False)`` text).

        Args:
            messages: OpenAI ``messages`` (validated by ``normalize_messages``); keys with a null value are
                dropped before the template sees them, as HF does.
            add_generation_prompt: append the assistant header (``<|im_start|>assistant\\n``).
            continue_final_message: the final message must be the assistant's; the prompt ends with its
                content with no end marker and no new header, so generation continues that text (HF
                semantics: its trailing whitespace is kept when the template keeps it, else stripped).
            tools: OpenAI ``tools`` list (JSON-schema dicts) passed to the template as ``tools`` (ignored by
                templates that do not use it; see ``supports_tools``).
            extra_context: more template variables (e.g. ``documents``, ``enable_thinking``); cannot override
                the ones above. ``documents`` is None unless given (HF).

        Returns:
            ChatPrompt(text, ids).

        Raises:
            InvalidConversation: bad messages (see ``normalize_messages``); both flags true
                (param ``continue_final_message``); continue_final_message with a final message that is not
                the assistant's (``messages[i].role``); ``tools`` not a list of objects (param ``tools``); an
                assistant message with null content (it has ``tool_calls``) that a template not rendering
                ``tool_calls`` fails on (``messages[i].content``, code ``unsupported_value``); a value in
                ``messages`` or ``tools`` nested too deeply to walk (Python's recursion limit; param
                ``messages``).
            TemplateRejected: param ``messages``, code ``invalid_value``: the template called
                ``raise_exception`` (message "The model's chat template raised: <its message>"), or failed on
                this input (the message names the feature: an unknown filter, a value the conversation lacks,
                an operation the sandbox forbids, a value of the wrong type; no Python exception class), or it
                does not render the final message's content that continue_final_message continues.
        """
        if continue_final_message and add_generation_prompt:
            raise InvalidConversation(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                param="continue_final_message",
            )
        msgs = normalize_messages(messages)
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise InvalidConversation("'tools' must be an array of objects.", param="tools")

        neut = _Neutralizer(self._specials)
        try:
            tmsgs = neut.apply([_template_message(m) for m in msgs])
            tools_n = neut.apply(tools) if tools is not None else None
        except RecursionError:  # a member nested hundreds deep (a tool call's arguments string included)
            raise InvalidConversation(
                "'messages' or 'tools' holds a value nested too deeply to render.",
                param="messages",
                code="invalid_value",
            ) from None

        # HF's continue tag: a marker with a trailing space tells whether the template trimmed the content.
        marker = None
        if continue_final_message:
            if msgs[-1]["role"] != "assistant":
                raise InvalidConversation(
                    "'continue_final_message' needs the final message to be from the assistant.",
                    param=f"messages[{len(msgs) - 1}].role",
                )
            marker = "\U000f0002" + secrets.token_hex(8) + "\U000f0003 "
            tmsgs[-1]["content"] = tmsgs[-1].get("content", "") + marker

        ctx = {"documents": None, **(extra_context or {}), **self._token_vars}
        ctx.update(messages=tmsgs, tools=tools_n, add_generation_prompt=add_generation_prompt)
        try:
            text = self._template.render(**ctx)
        except TemplateRaised as e:
            raise TemplateRejected(
                f"The model's chat template raised: {e}", param="messages", code="invalid_value"
            ) from None
        except RENDER_ERRORS as e:
            self._null_content_check(msgs)
            log.info("chat template failed on a request: %s", type(e).__name__)
            raise TemplateRejected(
                f"The model's chat template cannot render these messages: {describe_failure(e)}.",
                param="messages",
                code="invalid_value",
            ) from None

        if marker is not None:
            cut = text.rfind(marker.strip())
            if cut < 0:
                raise TemplateRejected(
                    "'continue_final_message': the chat template does not render the final message's content.",
                    param="messages",
                    code="invalid_value",
                )
            text = text[:cut] if text.startswith(marker, cut) else text[:cut].rstrip()

        return ChatPrompt(text=neut.restore(text), ids=self._tokenize(text, neut))

    def _null_content_check(self, msgs: list[dict[str, Any]]) -> None:
        """After a failed render: an assistant's null content is the likely cause when the template does not
        render ``tool_calls`` (SmolLM2's concatenates every content); say so instead of a template error."""
        if self.supports_tool_calls:
            return
        for i, m in enumerate(msgs):
            if m["content"] is None:
                raise InvalidConversation(
                    f"'messages[{i}].content' is null, but this model's chat template does not render 'tool_calls': "
                    "give the assistant message a text content.",
                    param=f"messages[{i}].content",
                    code="unsupported_value",
                )

    def _tokenize(self, text: str, neut: _Neutralizer) -> list[int]:
        """Special ids for the special-token strings in ``text`` (all written by the template, since client
        strings carry placeholders instead), ordinary tokens for each piece between them, and BOS first when
        the tokenizer adds one and the template did not write it.

        The tokenizer's strip flags apply as llama.cpp's ``tokenizer_st_partition`` applies them: the piece
        after a special id in ``rstrip_ids`` loses its leading ASCII whitespace (C ``isspace``), the piece
        before one in ``lstrip_ids`` its trailing whitespace, and a piece left empty is dropped (Phi-3:
        ``<|user|>\\nHi<|end|>\\n`` gives ``<|user|> ▁Hi <|end|>``; HF ``tokenizers`` strips Unicode
        whitespace there, which differs only for non-ASCII spaces next to such a token).

        BOS: llama.cpp's chat path strips a rendered BOS and lets the tokenizer add it back (``add_bos``);
        HF's templates write ``bos_token`` themselves. Either way the prompt starts with exactly one BOS:
        added here only when ``add_bos_token`` holds and the ids do not already start with it.
        """
        tok = self.tokenizer
        pieces: list[str | int] = []
        pos = 0
        for m in self._special_re.finditer(text) if self._special_re is not None else ():
            if m.start() > pos:
                pieces.append(neut.restore(text[pos : m.start()]))
            pieces.append(self._special_id[m.group(0)])
            pos = m.end()
        if pos < len(text):
            pieces.append(neut.restore(text[pos:]))
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if isinstance(piece, int):
                ids.append(piece)
                continue
            if k > 0 and pieces[k - 1] in tok.rstrip_ids:
                piece = piece.lstrip(_C_SPACE)
            if k + 1 < len(pieces) and pieces[k + 1] in tok.lstrip_ids:
                piece = piece.rstrip(_C_SPACE)
            ids.extend(tok.encode_plain(piece))
        bos = tok.bos_token_id
        if tok.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids
