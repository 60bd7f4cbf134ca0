"""Errors of templating: a conversation that the model's chat template cannot turn into a prompt, and a
tokenizer that cannot be loaded at start.

::

    Exception
    ├── TemplateError                a request's conversation (an HTTP layer answers 400)
    │   ├── InvalidConversation
    │   └── TemplateRejected
    └── TokenizerError               the model's tokenizer cannot be built (start-up: one line, exit)
        ├── UnsupportedTokenizer     also ValueError: a GGUF tokenizer kind this package does not build
        └── TokenizerFileMissing     also FileNotFoundError: no such file, or a directory without tokenizer.json

A ``TemplateError`` carries the members of an OpenAI error object
(https://platform.openai.com/docs/guides/error-codes) so that an HTTP layer can answer 400
``invalid_request_error`` with them unchanged; templating itself knows nothing of HTTP. Messages name no Python
exception and no template internals. A ``TokenizerError``'s ``str()`` is one line that says what to pass instead.
"""

from __future__ import annotations


class TemplateError(Exception):
    """Base of the errors :mod:`templating` raises for a request's conversation.

    Attributes:
        message: human-readable text for the client.
        param: the offending request field (``messages``, ``messages[2].content[0].type``, ``tools``,
            ``continue_final_message``) or None.
        code: machine-readable code (``invalid_value``, ``unsupported_value``) or None.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidConversation(TemplateError):
    """The request is not a conversation the chat API accepts, checked before rendering: ``messages`` of the
    wrong shape, an unknown role, a non-text content part, ``tools`` not an array of objects, conflicting
    generation-prompt flags, or something the model's template cannot express (null assistant content
    without ``tool_calls`` support)."""


class TemplateRejected(TemplateError):
    """The chat template refused the conversation (its ``raise_exception``), failed on it (a value of a type
    it cannot handle), or did not render what ``continue_final_message`` needs (param ``messages``)."""


class TokenizerError(Exception):
    """Base of the errors raised while loading a model's tokenizer; ``str()`` is one line."""


class UnsupportedTokenizer(TokenizerError, ValueError):
    """A GGUF file names a tokenizer kind that is not built here.

    Attributes:
        key: the metadata key (``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``).
        value: its value in the file (None when the key is absent).
        supported: the values that are built, in the order the message lists them.
    """

    def __init__(self, key: str, value: object, supported: tuple[str, ...]) -> None:
        self.key = key
        self.value = value
        self.supported = supported
        super().__init__(f"unsupported tokenizer: {key} = {value!r} (supported: {', '.join(supported)})")


class TokenizerFileMissing(TokenizerError, FileNotFoundError):
    """The tokenizer source does not exist, or is a directory without ``tokenizer.json``.

    Attributes:
        path: the missing file (``str``).
    """

    def __init__(self, path: str, hint: str) -> None:
        self.path = path
        super().__init__(f"{path} not found: {hint}")
