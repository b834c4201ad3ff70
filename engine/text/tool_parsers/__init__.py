"""Tool-call parsers for ``tool_choice: "auto"``: the model's own tool-call format to OpenAI's ``tool_calls``.

Chosen by ``--tool-call-parser`` (SGLang's flag and names); the registry's names
are the flag's choices. A parser takes a choice's whole text (``parse``); while
it streams, ``ToolCallStream`` sends the content up to where a call may begin
(``hold_from``) and parses the rest when the output ends. A call that does not
parse leaves the text as content.
"""

from __future__ import annotations

from pdserve.engine.text.tool_parsers.base import ToolCall, ToolCallParser, dict_tool_call, json_tool_call
from pdserve.engine.text.tool_parsers.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from pdserve.engine.text.tool_parsers.hermes import HermesParser
from pdserve.engine.text.tool_parsers.json_formats import Llama3Parser, MistralParser
from pdserve.engine.text.tool_parsers.kimi import KimiK2Parser
from pdserve.engine.text.tool_parsers.pythonic import PythonicParser
from pdserve.engine.text.tool_parsers.xml_formats import Glm45Parser, Qwen3CoderParser

# --tool-call-parser names (SGLang's): qwen and qwen25 write the hermes format
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "deepseekv3": DeepSeekV3Parser,
    "deepseekv31": DeepSeekV31Parser,
    "glm45": Glm45Parser,
    "hermes": HermesParser,
    "kimi_k2": KimiK2Parser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen": HermesParser,
    "qwen25": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
}


def make_tool_call_parser(name: str, functions: dict[str, dict] | None = None) -> ToolCallParser:
    """The parser of a ``--tool-call-parser`` name (``ServerConfig`` checked it); ``functions``: the
    request's tools, name -> parameters schema."""
    return TOOL_CALL_PARSERS[name](functions)


__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolCallParser", "dict_tool_call", "json_tool_call",
           "make_tool_call_parser", "HermesParser"]
