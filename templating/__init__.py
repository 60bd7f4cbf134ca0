"""Text side of the gateway: tokenizer loading and chat templating (see docs/text.md).

Public API::

    from templating import load_tokenizer, ChatTemplate, ChatPrompt, TextTokenizer
"""

from templating.chat_template import TEXT_PART_SEPARATOR, ChatPrompt, ChatTemplate, normalize_messages
from templating.tokenizer import TextTokenizer, cached_tokenizer, load_tokenizer

__all__ = [
    "ChatPrompt",
    "ChatTemplate",
    "TEXT_PART_SEPARATOR",
    "TextTokenizer",
    "cached_tokenizer",
    "load_tokenizer",
    "normalize_messages",
]
