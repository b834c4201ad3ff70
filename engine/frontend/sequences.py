"""A request body expanded into sequences, with their sampling parameters.

``generate_sequences``, ``completion_sequences`` and ``chat_sequences`` validate a decoded body
(``request_schemas.py``; the value checks in ``value_checks.py``, the grammars in
``grammar_fields.py``) and expand it into ``SequenceSpec``s: one per prompt and choice, each
becoming one ``TokenizedGenerateReq`` once the tokenizer manager has tokenized it. The offline
``Engine`` builds a ``GenerateRequest`` from its arguments (``request_error.convert_body``) and
takes the same path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.engine.frontend import refused_fields
from pdserve.engine.frontend.lora_fields import generate_adapters, openai_adapter
from pdserve.engine.frontend.grammar_fields import chat_tools, one_grammar, response_format_schema, sglang_grammars
from pdserve.engine.frontend.request_error import RequestError
from pdserve.engine.frontend.request_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
    OpenAICommon,
)
from pdserve.engine.frontend.reasoning_fields import ReasoningPlan, after_thinking, chat_reasoning
from pdserve.engine.frontend.tool_calls import ToolPlan
from pdserve.engine.frontend.value_checks import (
    RequestLimits,
    bootstrap_infos,
    check_dp_rank,
    check_ids,
    check_max_tokens,
    check_n,
    is_int_list,
    pick,
    refuse_generate,
    refuse_openai,
    sequence_rids,
    stop_list,
    check_batch_size,
    unsupported,
)
from pdserve.engine.messages import BootstrapInfo
from pdserve.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from pdserve.engine.text.prompt import ChatPrompt


@dataclass
class SequenceSpec:
    """One sequence to generate: one prompt and one choice of a request."""

    index: int  # position of this output in the response (prompt i, choice j -> i * n + j)
    prompt_index: int
    prompt: str | list[int] | ChatPrompt
    sampling_params: SamplingParams
    rid: str
    max_tokens_given: bool  # False: clamp max_new_tokens to the room the context leaves
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    routed_dp_rank: int | None = None
    bootstrap: BootstrapInfo | None = None
    no_stop_trim: bool = False
    health_probe: bool = False  # /health_generate: run without a KV peer in the PD modes
    priority: int = 0  # the waiting queue's order with --enable-priority-scheduling
    # names of the body's fields, for errors found after tokenization
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    tool_plan: ToolPlan | None = None  # chat with tools: how the output becomes tool_calls
    reasoning: ReasoningPlan | None = None  # chat under --reasoning-parser: how the thinking is split off
    lora_path: str | None = None  # the LoRA adapter (lora_fields.py); None: the base model


# the sampling fields a /generate body's sampling_params and an OpenAI body share by name
_SAME_NAMED = ("temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos",
               "skip_special_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _same_named_fields(body) -> dict[str, Any]:
    """The SamplingParams keywords a request body gives under their own names, and its stop list."""
    return {"stop": stop_list(body.stop), **{k: getattr(body, k) for k in _SAME_NAMED}}


def _build_sampling(param_prefix: str, renames: dict[str, str], **kw) -> SamplingParams:
    """SamplingParams from the non-None values, validated; errors name the body's field."""
    values = {k: v for k, v in kw.items() if v is not None}
    sp = SamplingParams(**values)
    try:
        sp.validate()
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        body_name = renames.get(name, name)
        message = str(e).replace(name, body_name, 1)
        raise RequestError(message, param=f"{param_prefix}{body_name}") from None
    return sp


def generate_sequences(
    req: GenerateRequest, limits: RequestLimits, text_param: str = "text"
) -> tuple[list[SequenceSpec], bool]:
    """Expand a /generate body; returns the sequences and whether the body was a batch.

    ``text_param``: the name errors give the ``text`` field (the offline Engine calls it ``prompt``)."""
    refuse_generate(req)
    limits.check_model(req.model)
    if (req.text is None) == (req.input_ids is None):
        raise RequestError(f"exactly one of `{text_param}` and `input_ids` must be given", param=text_param)
    prompts: list[str | list[int]]
    if req.text is not None:
        is_batch = isinstance(req.text, list)
        prompts = list(req.text) if is_batch else [req.text]
        prompt_param = text_param
    else:
        ids = req.input_ids
        if is_int_list(ids):
            is_batch, prompts = False, [ids]
        elif isinstance(ids, list) and ids and all(is_int_list(x) for x in ids):
            is_batch, prompts = True, list(ids)
        else:
            raise RequestError("input_ids must be a list of token ids or a list of such lists", param="input_ids")
        for p in prompts:
            check_ids(p, limits.vocab_size, "input_ids")
        prompt_param = "input_ids"
    if is_batch and not prompts:
        raise RequestError(f"{prompt_param} must not be an empty batch", param=prompt_param)
    check_batch_size(len(prompts), prompt_param)
    for p in prompts:
        if len(p) == 0:
            raise RequestError(f"{prompt_param} must not be empty", param=prompt_param)
    num = len(prompts)

    sps = req.sampling_params
    if isinstance(sps, list):
        if len(sps) != num:
            raise RequestError(f"sampling_params has {len(sps)} entries for {num} prompts", param="sampling_params")
    gsps = [(pick(sps, i) or GenerateSamplingParams()) for i in range(num)]
    ns = set()
    per_prompt: list[tuple[SamplingParams, bool, bool]] = []
    for g in gsps:
        unsupported(g, ("structural_tag",))
        n = check_n(g.n, limits, "sampling_params.n")
        ns.add(n)
        check_max_tokens(g.max_new_tokens, "sampling_params.max_new_tokens", 0)
        sp = _build_sampling(
            "sampling_params.",
            {},
            max_new_tokens=g.max_new_tokens,
            min_new_tokens=g.min_new_tokens,
            **_same_named_fields(g),
            seed=g.sampling_seed if g.sampling_seed is not None else g.seed,
            n=1,
            **one_grammar("sampling_params.", sglang_grammars(g)),
        )
        if sp.stop_token_ids:
            check_ids(sp.stop_token_ids, limits.vocab_size, "sampling_params.stop_token_ids")
        per_prompt.append((sp, g.max_new_tokens is not None, bool(g.no_stop_trim)))
    if len(ns) > 1:
        raise RequestError("sampling_params.n must be the same for every prompt", param="sampling_params.n")
    n = ns.pop()
    is_batch = is_batch or n > 1

    for name in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
        v = getattr(req, name)
        if isinstance(v, list) and len(v) != num:
            raise RequestError(f"{name} has {len(v)} entries for {num} prompts", param=name)
    routed = check_dp_rank(req, limits)
    priority = limits.check_priority(req.priority)
    adapters = generate_adapters(req.lora_path, num, limits.lora_adapters)
    boots = bootstrap_infos(req, num, n, limits, req.disagg_prefill_dp_rank)
    rids = sequence_rids(req.rid, num, n)
    seqs = []
    for i in range(num):
        sp, given, no_trim = per_prompt[i]
        top_n = pick(req.top_logprobs_num, i) or 0
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
        start = pick(req.logprob_start_len, i)
        for j in range(n):
            seqs.append(
                SequenceSpec(
                    index=i * n + j,
                    prompt_index=i,
                    prompt=prompts[i],
                    sampling_params=_with_choice_seed(sp, j),
                    rid=rids[i * n + j],
                    max_tokens_given=True,  # /generate's default is SGLang's 128, not "up to the context"
                    return_logprob=bool(pick(req.return_logprob, i)),
                    top_logprobs_num=top_n,
                    logprob_start_len=-1 if start is None else start,
                    routed_dp_rank=routed,
                    bootstrap=boots[i * n + j],
                    priority=priority,
                    lora_path=adapters[i],
                    no_stop_trim=no_trim,
                    prompt_param=prompt_param,
                    max_tokens_param="sampling_params.max_new_tokens",
                )
            )
    return seqs, is_batch


def _with_choice_seed(sp: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n gets seed + j so that seeded choices differ from each other."""
    if j == 0 or sp.seed is None:
        return sp
    return msgspec.structs.replace(sp, seed=sp.seed + j)


def _openai_sampling(
    req: OpenAICommon, max_tokens: int | None, max_tokens_param: str, limits: RequestLimits,
    grammars: dict[str, Any] | None = None,
) -> SamplingParams:
    """``grammars``: the grammar fields to check (default SGLang's three on the body)."""
    unsupported(req, ("logit_bias",))
    if grammars is None:
        grammars = sglang_grammars(req)
    check_max_tokens(req.min_tokens, "min_tokens", 0)
    sp = _build_sampling(
        "",
        {"max_new_tokens": max_tokens_param, "min_new_tokens": "min_tokens"},
        max_new_tokens=max_tokens,
        min_new_tokens=req.min_tokens,
        **_same_named_fields(req),
        seed=req.seed,
        n=1,
        **one_grammar("", grammars),
    )
    if sp.stop_token_ids:
        check_ids(sp.stop_token_ids, limits.vocab_size, "stop_token_ids")
    return sp


def _with_model_defaults(req: OpenAICommon, limits: RequestLimits) -> OpenAICommon:
    """The request with the model's sampling defaults in the fields it left out (SGLang's
    ``--sampling-defaults model``; only temperature, top_p, top_k, min_p and repetition_penalty)."""
    unset = {k: v for k, v in limits.sampling_defaults.items() if getattr(req, k) is None}
    return msgspec.structs.replace(req, **unset) if unset else req


def _openai_sequences(
    req: OpenAICommon,
    prompts: list,
    sp: SamplingParams,
    max_tokens_given: bool,
    max_tokens_param: str,
    prompt_param: str,
    limits: RequestLimits,
    return_logprob: bool,
    top_logprobs: int,
    tool_plan: ToolPlan | None = None,
    reasoning: ReasoningPlan | None = None,
) -> list[SequenceSpec]:
    n = check_n(req.n, limits)
    adapter = openai_adapter(req.lora_path, req.model, limits.model_names, limits.lora_adapters)
    routed = check_dp_rank(req, limits)
    priority = limits.check_priority(req.priority)
    boots = bootstrap_infos(req, len(prompts), n, limits, req.disagg_prefill_dp_rank)
    rids = sequence_rids(req.rid, len(prompts), n)
    seqs = []
    for i, p in enumerate(prompts):
        for j in range(n):
            seqs.append(
                SequenceSpec(
                    index=i * n + j,
                    prompt_index=i,
                    prompt=p,
                    sampling_params=_with_choice_seed(sp, j),
                    rid=rids[i * n + j],
                    max_tokens_given=max_tokens_given,
                    return_logprob=return_logprob,
                    top_logprobs_num=top_logprobs,
                    routed_dp_rank=routed,
                    bootstrap=boots[i * n + j],
                    priority=priority,
                    no_stop_trim=bool(req.no_stop_trim),
                    prompt_param=prompt_param,
                    max_tokens_param=max_tokens_param,
                    tool_plan=tool_plan,
                    reasoning=reasoning,
                    lora_path=adapter,
                )
            )
    return seqs


def completion_sequences(req: CompletionRequest, limits: RequestLimits) -> list[SequenceSpec]:
    openai_adapter(req.lora_path, req.model, limits.model_names, limits.lora_adapters)  # model: base or adapter
    refuse_openai(req, refused_fields.COMPLETIONS)
    if req.echo:
        raise RequestError("`echo` is not supported by pdserve", param="echo", code="unsupported")
    p = req.prompt
    if p is None:
        raise RequestError("`prompt` is required", param="prompt")
    if isinstance(p, str):
        prompts = [p]
    elif is_int_list(p) and p:
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(is_int_list(x) for x in p):
        prompts = list(p)
    elif p == []:
        raise RequestError("prompt must not be empty", param="prompt")
    else:
        raise RequestError("prompt must be a string, a list of strings, or token ids", param="prompt")
    check_batch_size(len(prompts), "prompt")
    for x in prompts:
        if len(x) == 0:
            raise RequestError("prompt must not be empty", param="prompt")
        if isinstance(x, list):
            check_ids(x, limits.vocab_size, "prompt")
    n = req.n if req.n is not None else 1
    if req.best_of is not None and req.best_of != n:
        raise RequestError("best_of other than n is not supported by pdserve", param="best_of", code="unsupported")
    check_max_tokens(req.max_tokens, "max_tokens", 1)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", param="logprobs")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
    req = _with_model_defaults(req, limits)
    sp = _openai_sampling(req, max_tokens, "max_tokens", limits)
    return _openai_sequences(
        req, prompts, sp, True, "max_tokens", "prompt", limits, req.logprobs is not None, req.logprobs or 0
    )


def _message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    if m.role not in ("system", "user", "assistant", "tool", "developer"):
        raise RequestError(f"messages[{i}].role must be system, user, assistant, tool or developer", param=f"messages[{i}].role")
    content = m.content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    "only text content parts are supported by pdserve", param=f"messages[{i}].content[{k}]", code="unsupported"
                )
            texts.append(part["text"])
        content = "".join(texts)
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name is not None:
        d["name"] = m.name
    for key in ("tool_calls", "tool_call_id"):  # the chat template shows earlier calls and their results
        if getattr(m, key) is not None:
            d[key] = getattr(m, key)
    return d


def chat_sequences(req: ChatCompletionRequest, limits: RequestLimits) -> list[SequenceSpec]:
    openai_adapter(req.lora_path, req.model, limits.model_names, limits.lora_adapters)  # model: base or adapter
    unsupported(req, ("functions", "audio", "prediction"))
    tools = chat_tools(req, limits)
    grammars = sglang_grammars(req)
    rf = response_format_schema(req.response_format)
    if rf is not None:
        grammars[rf[0]] = rf[1]
    if tools.json_schema is not None:
        grammars["tools"] = tools.json_schema
    reasoning = chat_reasoning(req, limits.reasoning_parser)
    answer_grammar = rf is not None or tools.json_schema is not None  # held after the thinking
    if not req.messages:
        raise RequestError("messages must not be empty", param="messages")
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
    if all(not m["content"] for m in messages):
        raise RequestError("messages must not all be empty", param="messages")
    check_max_tokens(req.max_tokens, "max_tokens", 1)
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens", 1)
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = req.max_tokens, "max_tokens"
    top = req.top_logprobs
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
        if not req.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    refuse_openai(req, refused_fields.CHAT)
    req = _with_model_defaults(req, limits)
    sp = _openai_sampling(req, max_tokens, param, limits, grammars)
    if req.thinking_budget is not None:
        if reasoning is None:
            raise RequestError("thinking_budget needs a server started with --reasoning-parser and thinking on",
                               param="thinking_budget")
        if req.thinking_budget < 0:
            raise RequestError(f"thinking_budget must be >= 0, got {req.thinking_budget}", param="thinking_budget")
        sp = msgspec.structs.replace(sp, thinking_budget=req.thinking_budget, thinking_end=reasoning.fmt.end,
                                     thinking_start=None if reasoning.fmt.starts_inside else reasoning.fmt.start)
    if reasoning is not None and answer_grammar:
        kind = next(k for k in ("json_schema", "regex", "ebnf") if getattr(sp, k) is not None)
        sp = msgspec.structs.replace(sp, json_schema=None, regex=None,
                                     ebnf=after_thinking(reasoning.fmt, kind, getattr(sp, kind)))
    template_kwargs = dict(req.chat_template_kwargs or {})
    if tools.template_tools:
        template_kwargs["tools"] = tools.template_tools
    prompt = ChatPrompt(messages, bool(req.continue_final_message), template_kwargs)
    return _openai_sequences(
        req, [prompt], sp, max_tokens is not None, param, "messages", limits, bool(req.logprobs), top or 0,
        tools.plan, reasoning,
    )
