"""A chat request's reasoning: whether its output is split into ``reasoning_content`` and ``content``,
and the grammar that holds only the answer after the thinking.

With ``--reasoning-parser`` the split is on unless the request turns it off
(``separate_reasoning: false``, SGLang's field) or turns the model's thinking off
(``chat_template_kwargs`` ``enable_thinking``/``thinking`` false, which the chat
template also sees). ``stream_reasoning: false`` sends the reasoning in one delta
once the thinking ends instead of as it comes.

``response_format`` and ``tools`` describe the answer, so under a reasoning
parser their grammar is prefixed with a free thinking part: the marker-delimited
thinking (its closing marker the only way out), then the answer's grammar.
SGLang's raw ``regex``, ``ebnf`` and ``json_schema`` fields hold the whole output,
thinking included, as given.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.text.reasoning_parsers import ReasoningFormat, make_reasoning_format, thinking_enabled


@dataclass(frozen=True)
class ReasoningPlan:
    fmt: ReasoningFormat
    separate: bool = True  # reasoning_content apart from content (False: all in content)
    stream: bool = True  # stream the reasoning as it comes (False: in one delta when it ends)


def chat_reasoning(req, parser_name: str | None) -> ReasoningPlan | None:
    """The reasoning plan of a chat request; None: its output is plain content."""
    if parser_name is None or not thinking_enabled(req.chat_template_kwargs or {}):
        return None
    return ReasoningPlan(make_reasoning_format(parser_name), separate=req.separate_reasoning is not False,
                         stream=req.stream_reasoning is not False)


def _char_class(exclude: str) -> str:
    escaped = "".join("\\" + c if c in "\\]^-[" else c for c in dict.fromkeys(exclude))
    return f"[^{escaped}]"


def thinking_ebnf(fmt: ReasoningFormat) -> str:
    """EBNF of a thinking part: the opening marker (optional where the prompt opened the thinking), text
    without the closing marker, the closing marker.

    The text is a loop over "a character that does not begin the closing marker" or "a proper
    prefix of the marker followed by a character that does not continue it" (the marker's first
    character, which occurs in it once, starts the match over). The thinking cannot end with a
    proper prefix of the marker."""
    end = fmt.end
    first = end[0]
    rules = []
    for i in range(1, len(end)):  # rest_i: after end[:i] was seen, anything but end[i] (or first: restart)
        ch = _json_str(end[i])
        nxt = f" | {ch} rest_{i + 1}" if i + 1 < len(end) else ""
        restart = f" | {_json_str(first)} rest_1"  # the marker's first character: its match starts over
        rules.append(f"rest_{i} ::= {_char_class(end[i] + first)}{nxt}{restart}")
    return "\n".join([
        f"root ::= {_json_str(fmt.start)}{'?' if fmt.starts_inside else ''} think_text {_json_str(end)}",
        f"think_text ::= ({_char_class(first)} | {_json_str(first)} rest_1)*",
        *rules,
    ])


def _json_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def after_thinking(fmt: ReasoningFormat, kind: str, text: str) -> str:
    """The EBNF of ``kind``'s grammar ``text`` (``grammar_spec.GRAMMAR_FIELDS``) preceded by a thinking part."""
    import xgrammar as xgr  # the request's grammar was already parsed with it

    answer = {"json_schema": lambda t: xgr.Grammar.from_json_schema(t, any_whitespace=False),
              "regex": xgr.Grammar.from_regex, "ebnf": xgr.Grammar.from_ebnf}[kind](text)
    return str(xgr.Grammar.concat(xgr.Grammar.from_ebnf(thinking_ebnf(fmt)), answer))
