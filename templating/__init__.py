"""Text side of the gateway: tokenizer loading and chat templating (see docs/text.md).

Public API::

    from templating import load_tokenizer, ChatTemplate, ChatPrompt, TextTokenizer
    from templating import TemplateError  # base of InvalidConversation, TemplateRejected
"""

from templating.chat_template import TEXT_PART_SEPARATOR, ChatPrompt, ChatTemplate, normalize_messages
from templating.errors import InvalidConversation, TemplateError, TemplateRejected
from templating.tokenizer import TextTokenizer, cached_tokenizer, load_tokenizer

__all__ = [
    "ChatPrompt",
    "ChatTemplate",
    "InvalidConversation",
    "TEXT_PART_SEPARATOR",
    "TemplateError",
    "TemplateRejected",
    "TextTokenizer",
    "cached_tokenizer",
    "load_tokenizer",
    "normalize_messages",
]
