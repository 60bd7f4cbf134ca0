"""Text side of the gateway: tokenizer loading and chat templating (see docs/text.md).

Public API::

    from templating import load_tokenizer, ChatTemplate, ChatPrompt, TextTokenizer
"""

from templating.chat_template import TEXT_PART_SEPARATOR, ChatPrompt, ChatTemplate, normalize_messages
from templating.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["ChatPrompt", "ChatTemplate", "TEXT_PART_SEPARATOR", "TextTokenizer", "load_tokenizer", "normalize_messages"]
