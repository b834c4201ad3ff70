"""The structured-output parts without a server: grammar checks, masks and matchers on the default
model's vocabulary, the stop rule, and the tool-call plans and parsers."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.constrained.grammar_masks import GrammarMasks
from pdserve.engine.constrained.grammar_spec import InvalidGrammar, check_grammar, schema_text
from pdserve.engine.frontend.tool_calls import ToolCallStream, ToolRequestError, tool_choice
from pdserve.engine.text.tool_parsers import HermesParser
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.request import Req
from pdserve.engine.sched.stop_checker import StopChecker

EOS = 2  # SmolLM2-Instruct's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def masks(tokenizer):
    return GrammarMasks(tokenizer, 49152, [EOS])


@pytest.mark.parametrize("kind,text", [("json_schema", '{"type": "nope"}'), ("regex", "a{2"),
                                       ("ebnf", "root ::= missing")])
def test_check_grammar_names_the_field(kind, text):
    with pytest.raises(InvalidGrammar) as e:
        check_grammar(kind, text, f"x.{kind}")
    assert e.value.field == f"x.{kind}" and str(e.value).startswith(f"x.{kind} is invalid: ")
    check_grammar(kind, {"json_schema": '{"type": "string"}', "regex": "a{2}", "ebnf": 'root ::= "a"'}[kind])


def test_schema_text():
    assert json.loads(schema_text("f", {"type": "object"})) == {"type": "object"}
    with pytest.raises(InvalidGrammar, match="not JSON"):
        schema_text("f", "{")
    with pytest.raises(InvalidGrammar, match="object"):
        schema_text("f", "[1]")


def test_one_grammar_per_request():
    assert SamplingParams(regex="a").grammar == ("regex", "a")
    assert SamplingParams().grammar is None
    with pytest.raises(ValueError, match="^ebnf cannot be combined with regex"):
        SamplingParams(regex="a", ebnf='root ::= "a"').validate()


def test_masked_greedy_decoding_follows_the_grammar_and_stops(tokenizer, masks):
    """Row 0 constrained, row 1 not: masking then greedy argmax spells the regex, then EOS ends it."""
    grammar = masks.matcher(("regex", "(yes|no)!"))
    req = Req("r", [1], SamplingParams(regex="(yes|no)!", max_new_tokens=50))
    req.grammar = grammar
    stop = StopChecker([EOS], tokenizer)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        pending = masks.begin([grammar, None])
        logits = torch.randn(2, 49152, generator=gen)
        free_row = logits[1].clone()
        pending.apply(logits)
        assert torch.equal(logits[1], free_row), "an unconstrained row is left alone"
        token = int(logits[0].argmax())
        grammar.accept(token)
        req.output_ids.append(token)
        reason = stop(req)
        if reason is not None:
            break
    assert reason.type == "stop" and reason.matched == EOS and grammar.terminated
    assert tokenizer.decode(req.output_ids, skip_special_tokens=True) in ("yes!", "no!")
    assert masks.begin([None, None]) is None


def test_matcher_replays_a_token(masks):
    """The decode side's replay: after accepting prefill's first token, the grammar continues from it."""
    grammar = masks.matcher(("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'))
    pending = masks.begin([grammar])
    logits = torch.zeros(1, 49152)
    pending.apply(logits)
    first = int(logits[0].argmax())
    grammar.accept(first)
    assert grammar.rejected_token is None
    logits = torch.zeros(1, 49152)
    masks.begin([grammar]).apply(logits)
    assert logits[0, first] == float("-inf"), "after the opening brace, another one is forbidden"
    grammar.accept(first)  # "{" again is not JSON: refused, and the request would end with an error
    assert grammar.rejected_token == first


def test_bad_grammar_in_the_scheduler_is_a_value_error(masks):
    with pytest.raises(ValueError, match="regex is invalid"):
        masks.matcher(("regex", "(a"))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop"}}]


def test_tool_choice_plans():
    assert tool_choice(None, None, None, None).plan is None
    req = tool_choice(TOOLS, "required", False, None)
    schema = json.loads(req.json_schema)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    content, calls = req.plan.parse('[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    named = tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert json.loads(named.json_schema)["required"] == ["city"]
    assert named.plan.parse('{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'
    with pytest.raises(ToolRequestError) as e:
        tool_choice(TOOLS, "auto", None, None)
    assert e.value.param == "tool_choice"
    with pytest.raises(ToolRequestError) as e:
        tool_choice([{"type": "function"}], "required", None, None)
    assert e.value.param == "tools[0]"
    assert tool_choice(TOOLS, "auto", None, "hermes").plan.mode == "auto"


def test_hermes_parser():
    p = HermesParser()
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = p.parse(text)
    assert content == "Let me check." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Rome"}
    assert p.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert p.parse("plain") == ("plain", [])


def test_streamed_auto_holds_back_a_possible_call():
    ts = ToolCallStream(tool_choice(TOOLS, "auto", None, "hermes").plan)
    out = []
    for piece in ["Sure", ". <tool", '_call>{"name": "noop", ', '"arguments": {}}</tool_call>']:
        out += ts.feed(piece, False)
    out += ts.feed("", True)
    assert out[0] == {"content": "Sure"}
    assert out[1] == {"content": ". "}
    assert out[-1]["tool_calls"][0]["function"] == {"name": "noop", "arguments": "{}"}
    assert ts.num_calls == 1


def test_streamed_named_call_streams_arguments():
    ts = ToolCallStream(tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None,
                                    None).plan)
    out = ts.feed('{"city": ', False) + ts.feed('"Oslo"}', True)
    assert out[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in out[1:]) == '{"city": "Oslo"}'


def test_forbidden_rows_are_exactly_where_the_mask_changes_the_argmax(masks):
    """The greedy shortcut (mask only rows whose argmax the grammar forbids) picks what full masking picks."""
    grammars = [masks.matcher(("regex", "[0-9]+")), None, masks.matcher(("json_schema", '{"type": "boolean"}'))]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        logits = torch.randn(3, 49152, generator=gen)
        full = logits.clone()
        masks.begin(grammars).apply(full)
        pending = masks.begin(grammars)
        ids = logits.argmax(-1)
        rows = pending.forbidden_rows(ids)
        assert 1 not in rows
        assert rows == [i for i in (0, 2) if full[i, ids[i]] == float("-inf")]
        pending.apply(logits, rows)
        ids[rows] = logits[rows].argmax(-1)
        assert ids.tolist() == full.argmax(-1).tolist()
    # a row whose argmax is allowed is not masked: a digit made the largest logit of row 0
    logits = torch.randn(3, 49152, generator=gen)
    full = logits.clone()
    masks.begin(grammars).apply(full)
    logits[0, int(full[0].argmax())] = 100.0
    assert 0 not in masks.begin(grammars).forbidden_rows(logits.argmax(-1))


def test_the_compiled_grammar_cache_stays_under_its_byte_cap(tokenizer, monkeypatch):
    """Every distinct schema compiled stays in xgrammar's cache unless it is capped: the compiler
    is built with ``GRAMMAR_CACHE_BYTES`` and evicts past it (here a 256 KiB cap, 40 schemas)."""
    from pdserve.engine.constrained import grammar_backend

    cap = 256 * 2**10
    monkeypatch.setattr(grammar_backend, "GRAMMAR_CACHE_BYTES", cap)
    backend = grammar_backend.GrammarBackend(tokenizer, 49152, [EOS])
    compiler = backend._compiler  # noqa: SLF001 - the cap is the compiler's own setting
    assert compiler.cache_limit_bytes == cap
    sizes = []
    for i in range(40):
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "string"} for j in range(8)},
                  "required": [f"field_{i}_0"]}
        backend.matcher("json_schema", json.dumps(schema))
        sizes.append(compiler.get_cache_size_bytes())
    one = sizes[0]  # one compiled schema; 40 of them uncapped would hold over 10x the cap
    assert one > 0 and 40 * one > 10 * cap
    # eviction runs after an insert: at most one entry over the cap at any time
    assert max(sizes) < cap + one, sizes
