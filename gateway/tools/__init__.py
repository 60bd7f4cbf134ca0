"""Tool calling: OpenAI ``tools`` -> a ``ToolPlan`` (``spec``), a format's prompt text, llguidance grammar
and streaming output parser (``parser`` interfaces and the choice of format by chat template; Hermes
``<tool_call>`` blocks in ``hermes``, Llama 3 JSON in ``llama3``, Mistral ``[TOOL_CALLS]`` in ``mistral``;
shared pieces in ``grammar``, ``history``, ``jsoncall``). See ``docs/tools.md``."""

from gateway.tools.hermes import HermesFormat, HermesParser
from gateway.tools.llama3 import Llama3Format
from gateway.tools.mistral import MistralFormat
from gateway.tools.parser import ToolCall, ToolCallDelta, ToolFormat, ToolParser, new_call_id, tool_format
from gateway.tools.spec import MAX_SCHEMA_DEPTH, FunctionTool, ToolMode, ToolPlan, parse_tools

__all__ = [
    "FunctionTool",
    "ToolMode",
    "ToolPlan",
    "parse_tools",
    "MAX_SCHEMA_DEPTH",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolFormat",
    "tool_format",
    "new_call_id",
    "HermesFormat",
    "HermesParser",
    "Llama3Format",
    "MistralFormat",
]
