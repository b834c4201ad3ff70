"""Refuse, never ignore: every request field pdserve does not implement is a 400 naming it, on each
of /generate, /v1/completions and /v1/chat/completions, while the same field at its default value
(what SGLang's router sends on every request) is accepted."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.engine.frontend import refused_fields
from pdserve.engine.frontend.request_error import RequestError, decode_body
from pdserve.engine.frontend.request_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
    StreamOptions,
)
from pdserve.engine.frontend.sequences import chat_sequences, completion_sequences, generate_sequences
from pdserve.engine.frontend.value_checks import RequestLimits

LIMITS = RequestLimits(model_names=frozenset({"m"}), max_n=4, dp_size=1, vocab_size=1000)
MSG = [{"role": "user", "content": "hi"}]


def _gen(extra: dict, sp: dict | None = None):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, **(sp or {})}, **extra}
    return generate_sequences(decode_body(msgspec.json.encode(body), GenerateRequest), LIMITS)


def _comp(extra: dict):
    return completion_sequences(decode_body(msgspec.json.encode({"prompt": "hi", **extra}), CompletionRequest), LIMITS)


def _chat(extra: dict):
    body = {"messages": MSG, **extra}
    return chat_sequences(decode_body(msgspec.json.encode(body), ChatCompletionRequest), LIMITS)


# (endpoint, field path as the error names it, body) -- one per refused field and endpoint
CASES = [
    ("generate", "lora_path", lambda: _gen({"lora_path": "adapter"})),
    ("generate", "lora_id", lambda: _gen({"lora_id": "a1"})),
    ("generate", "custom_logit_processor", lambda: _gen({"custom_logit_processor": "{}"})),
    ("generate", "session_params", lambda: _gen({"session_params": {"id": "s"}})),
    ("generate", "priority", lambda: _gen({"priority": 3})),
    ("generate", "extra_key", lambda: _gen({"extra_key": "tenant"})),
    ("generate", "custom_labels", lambda: _gen({"custom_labels": {"a": "b"}})),
    ("generate", "conversation_id", lambda: _gen({"conversation_id": "c"})),
    ("generate", "modalities", lambda: _gen({"modalities": ["image"]})),
    ("generate", "image_data", lambda: _gen({"image_data": "x.png"})),
    ("generate", "input_embeds", lambda: _gen({"input_embeds": [[0.1]]})),
    ("generate", "token_ids_logprob", lambda: _gen({"token_ids_logprob": [1]})),
    ("generate", "return_hidden_states", lambda: _gen({"return_hidden_states": True})),
    ("generate", "return_bytes", lambda: _gen({"return_bytes": True})),
    ("generate", "return_entropy", lambda: _gen({"return_entropy": True})),
    ("generate", "background", lambda: _gen({"background": True})),
    ("generate", "log_metrics", lambda: _gen({"log_metrics": False})),
    ("generate", "sampling_params.custom_params", lambda: _gen({}, {"custom_params": {"k": 1}})),
    ("generate", "sampling_params.logit_bias", lambda: _gen({}, {"logit_bias": {"5": 3.0}})),
    ("generate", "sampling_params.stream_interval", lambda: _gen({}, {"stream_interval": 4})),
    ("generate", "sampling_params.spaces_between_special_tokens",
     lambda: _gen({}, {"spaces_between_special_tokens": False})),
    ("completions", "lora_path", lambda: _comp({"lora_path": "adapter"})),
    ("completions", "session_params", lambda: _comp({"session_params": {"id": "s"}})),
    ("completions", "priority", lambda: _comp({"priority": 1})),
    ("completions", "custom_logit_processor", lambda: _comp({"custom_logit_processor": "{}"})),
    ("completions", "custom_params", lambda: _comp({"custom_params": {"k": 1}})),
    ("completions", "extra_key", lambda: _comp({"extra_key": "t"})),
    ("completions", "return_hidden_states", lambda: _comp({"return_hidden_states": True})),
    ("completions", "spaces_between_special_tokens", lambda: _comp({"spaces_between_special_tokens": False})),
    ("completions", "suffix", lambda: _comp({"suffix": "end"})),
    ("completions", "stream_options.continuous_usage_stats",
     lambda: _comp({"stream": True, "stream_options": {"continuous_usage_stats": True}})),
    ("chat", "lora_path", lambda: _chat({"lora_path": "adapter"})),
    ("chat", "session_params", lambda: _chat({"session_params": {"id": "s"}})),
    ("chat", "priority", lambda: _chat({"priority": 1})),
    ("chat", "custom_logit_processor", lambda: _chat({"custom_logit_processor": "{}"})),
    ("chat", "return_hidden_states", lambda: _chat({"return_hidden_states": True})),
    ("chat", "modalities", lambda: _chat({"modalities": ["text", "audio"]})),
    ("chat", "store", lambda: _chat({"store": True})),
    ("chat", "metadata", lambda: _chat({"metadata": {"k": "v"}})),
    ("chat", "service_tier", lambda: _chat({"service_tier": "flex"})),
    ("chat", "reasoning_effort", lambda: _chat({"reasoning_effort": "high"})),
    ("chat", "web_search_options", lambda: _chat({"web_search_options": {}})),
    ("chat", "logit_bias", lambda: _chat({"logit_bias": {"5": 3.0}})),
    ("chat", "n", lambda: _chat({"n": 5})),  # more choices than --max-n
]


@pytest.mark.parametrize("endpoint,param,call", CASES, ids=[f"{e}:{p}" for e, p, _ in CASES])
def test_each_unsupported_field_is_a_400_naming_it(endpoint, param, call):
    with pytest.raises(RequestError) as e:
        call()
    assert e.value.status == 400 and e.value.param == param, e.value.to_dict()
    assert param.split(".")[-1] in e.value.message


def test_every_refused_field_of_the_table_is_in_the_cases_and_in_the_schema():
    tables = {
        "generate": (refused_fields.GENERATE, GenerateRequest, ""),
        "sampling_params": (refused_fields.SAMPLING_PARAMS, GenerateSamplingParams, "sampling_params."),
        "completions": (refused_fields.COMPLETIONS, CompletionRequest, ""),
        "chat": (refused_fields.CHAT, ChatCompletionRequest, ""),
        "stream_options": (refused_fields.STREAM_OPTIONS, StreamOptions, "stream_options."),
    }
    covered = {(e, p) for e, p, _ in CASES}
    for name, (table, struct, prefix) in tables.items():
        for field in table:
            assert field in struct.__struct_fields__, (name, field)
            endpoint = {"sampling_params": "generate", "stream_options": "completions"}.get(name, name)
            if name == "chat" and field in refused_fields.OPENAI:
                continue  # the OpenAI fields shared with completions are covered there
            if field in ("video_data", "audio_data"):
                continue  # like image_data
            assert (endpoint, prefix + field) in covered, (endpoint, prefix + field)


def test_default_values_are_accepted_as_sglangs_router_sends_them():
    _gen({"model": None, "log_metrics": True, "return_hidden_states": False, "background": False,
          "no_logs": False, "return_bytes": False, "return_entropy": False, "modalities": ["text"]},
         {"stream_interval": 1, "spaces_between_special_tokens": True, "logit_bias": {}})
    _comp({"return_hidden_states": False, "user": "u", "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
    _chat({"return_hidden_states": False, "separate_reasoning": True, "stream_reasoning": True,
           "store": False, "service_tier": "auto", "modalities": ["text"]})
