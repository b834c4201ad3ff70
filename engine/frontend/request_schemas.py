"""HTTP request bodies of the engine server, as msgspec Structs.

``GenerateRequest`` (SGLang's ``/generate``), ``CompletionRequest`` and ``ChatCompletionRequest``
(OpenAI's) forbid unknown fields, so a typo is a 400 naming it, while every field of OpenAI's or
SGLang's request schema is accepted; a field pdserve has no feature for is refused with a 400
naming it unless it carries its default value (``refused_fields.py``, docs/ARCHITECTURE.md
"SGLang wire compatibility"). ``sequences.py`` turns a body into sequences.
"""

from __future__ import annotations

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # SGLang/vLLM extra


class GenerateSamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    """``sampling_params`` of ``/generate``, with every name SGLang accepts."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int | None = None
    seed: int | None = None
    sampling_seed: int | None = None
    # structured output (checked by ``grammar_fields.one_grammar``); structural tags are not supported
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    # refused unless default (refused_fields.SAMPLING_PARAMS)
    custom_params: Any = None
    stream_interval: Any = None
    logit_bias: Any = None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of SGLang's ``POST /generate``."""

    text: str | list[str] | None = None
    input_ids: Any = None  # list[int] | list[list[int]]
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None  # SGLang's older name of routed_dp_rank
    disagg_prefill_dp_rank: int | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    bootstrap_pair_key: Any = None
    # SGLang extras: model is checked; the rest is refused unless default (refused_fields.GENERATE)
    model: str | None = None
    log_metrics: bool | None = None
    return_hidden_states: Any = None
    background: bool | None = None
    no_logs: bool | None = None
    return_bytes: bool | None = None
    return_entropy: bool | None = None
    modalities: Any = None
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    priority: int | None = None
    extra_key: Any = None
    custom_labels: Any = None
    conversation_id: Any = None
    # multimodal inputs: refused when non-null (refused_fields.GENERATE)
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None


class OpenAICommon(msgspec.Struct, forbid_unknown_fields=True):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then SGLang's)."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    rid: str | list[str] | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    bootstrap_pair_key: Any = None
    return_hidden_states: Any = None
    lora_path: Any = None
    session_params: Any = None
    priority: int | None = None
    custom_logit_processor: Any = None
    custom_params: Any = None
    extra_key: Any = None
    # structured output (SGLang's names, checked by ``grammar_fields.one_grammar``)
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None
    # vLLM's: each stream chunk's choice carries its new ``token_ids``, the first chunk the prompt's
    # ``prompt_token_ids`` (the router asks for them to migrate a stream, router/migration/openai_migration.py)
    return_token_ids: bool | None = None


class CompletionRequest(OpenAICommon, forbid_unknown_fields=True):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    reasoning_content: Any = None


class ChatCompletionRequest(OpenAICommon, forbid_unknown_fields=True):
    messages: list[ChatMessage] = []
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    function_call: Any = None
    functions: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    # SGLang extras
    continue_final_message: bool | None = False
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # under --reasoning-parser: output tokens the thinking may take before its closing marker is forced
    thinking_budget: int | None = None


def include_usage(req: OpenAICommon) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
