"""Errors of templating: a conversation that the model's chat template cannot turn into a prompt.

Each error carries the members of an OpenAI error object (https://platform.openai.com/docs/guides/error-codes)
so that an HTTP layer can answer 400 ``invalid_request_error`` with them unchanged; templating itself knows
nothing of HTTP. Messages name no Python exception and no template internals.
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
