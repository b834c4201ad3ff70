"""HTTP request bodies of the engine server, and their conversion to sequences.

Three endpoints share one path: the body is decoded into a msgspec Struct
(``GenerateRequest``, ``CompletionRequest``, ``ChatCompletionRequest``) that
forbids unknown fields, so a typo such as ``max_token`` is a 400 naming it,
while every field of OpenAI's or SGLang's request schema is accepted; a field
pdserve has no feature for is refused with a 400 naming it unless it carries
its default value (``refused_fields.py``, docs/ARCHITECTURE.md "SGLang wire
compatibility"). ``generate_sequences``, ``completion_sequences`` and
``chat_sequences`` then validate the values and expand the body into
``SequenceSpec``s: one per prompt and choice, each becoming one
``TokenizedGenerateReq`` once the tokenizer manager has tokenized it. The
offline ``Engine`` builds a ``GenerateRequest`` from its arguments
(``convert_body``) and takes the same path.

Every failure is a ``RequestError`` (a ``ValueError``) carrying the HTTP status
and the OpenAI error object's fields.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.engine.frontend import refused_fields
from pdserve.engine.constrained.grammar_spec import (
    GRAMMAR_FIELDS,
    JSON_OBJECT_SCHEMA,
    InvalidGrammar,
    check_grammar,
    schema_text,
)
from pdserve.engine.frontend.tool_calls import ToolPlan, ToolRequestError, tool_choice
from pdserve.engine.messages import BootstrapInfo
from pdserve.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams


class RequestError(ValueError):
    """A bad request, answered with OpenAI's error object (the offline Engine raises it as it is)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------
# request bodies


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
    # structured output (checked by ``_grammar``); structural tags are not supported
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


class _OpenAICommon(msgspec.Struct, forbid_unknown_fields=True):
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
    # structured output (SGLang's names, checked by ``_grammar``)
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None


class CompletionRequest(_OpenAICommon, forbid_unknown_fields=True):
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


class ChatCompletionRequest(_OpenAICommon, forbid_unknown_fields=True):
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


_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN_RE = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$\.?(.*)`)?")


def _invalid_body(e: msgspec.ValidationError) -> RequestError:
    """msgspec's validation error as a RequestError naming the field."""
    msg = str(e)
    m = _UNKNOWN_RE.match(msg)
    if m:
        name = m.group(1) if not m.group(2) else f"{m.group(2)}.{m.group(1)}"
        return RequestError(f"Unknown field `{name}` in the request body", param=name, code="unknown_field")
    m = _PATH_RE.search(msg)
    param = m.group(1) if m else None
    return RequestError(f"Invalid request body: {msg}", param=param, code="invalid_type")


def decode_body(body: bytes, type_: type[msgspec.Struct]) -> msgspec.Struct:
    """Decode a JSON body, turning msgspec's errors into RequestErrors naming the field."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise _invalid_body(e) from None
    except msgspec.DecodeError as e:
        raise RequestError(f"Invalid JSON body: {e}", code="invalid_json") from None


def convert_body(obj: dict[str, Any], type_: type[msgspec.Struct]) -> msgspec.Struct:
    """A body given as Python objects (the offline Engine's arguments), checked as ``decode_body`` checks JSON."""
    try:
        return msgspec.convert(msgspec.to_builtins(obj), type_)
    except msgspec.ValidationError as e:
        raise _invalid_body(e) from None
    except TypeError as e:  # an object with no JSON form
        raise RequestError(f"Invalid request body: {e}", code="invalid_type") from None


# ---------------------------------------------------------------------------------------------
# sequences


@dataclass
class ChatPrompt:
    """Messages to render with the model's chat template."""

    messages: list[dict[str, Any]]
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


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
    # names of the body's fields, for errors found after tokenization
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    tool_plan: ToolPlan | None = None  # chat with tools: how the output becomes tool_calls


@dataclass(frozen=True)
class RequestLimits:
    """What validation needs to know about the server and the model."""

    model_names: frozenset[str]
    max_n: int
    dp_size: int
    vocab_size: int
    disaggregation_mode: str = "null"
    max_local_prefill_tokens: int = 0  # decode mode: prompts this short may come without bootstrap fields
    # the OpenAI endpoints' defaults for the sampling fields a request leaves out (--sampling-defaults model)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def check_model(self, model: str | None) -> None:
        """A RequestError unless ``model`` is None or a name this server serves."""
        if model is not None and model not in self.model_names:
            raise RequestError(
                f"The model `{model}` does not exist; this server serves {sorted(self.model_names)[0]!r}",
                param="model",
                code="model_not_found",
            )
    tool_call_parser: str | None = None  # --tool-call-parser: tool_choice auto needs one


def new_rid() -> str:
    return uuid.uuid4().hex


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"{param} has token id {t}, outside the vocabulary [0, {vocab_size})", param=param)


def _check_model(model: str | None, limits: RequestLimits) -> None:
    limits.check_model(model)


def _check_dp_rank(req, limits: RequestLimits) -> int | None:
    for name in ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"):
        rank = getattr(req, name)
        if rank is None:
            continue
        if name == "disagg_prefill_dp_rank" and limits.disaggregation_mode != "prefill":
            if rank < 0:  # a decode server: the rank is the prefill server's, checked by its bootstrap server
                raise RequestError(f"{name} must be >= 0, got {rank}", param=name)
            continue
        if not 0 <= rank < limits.dp_size:
            raise RequestError(f"{name} must be in [0, {limits.dp_size}), got {rank}", param=name)
    if req.routed_dp_rank is not None:
        return req.routed_dp_rank
    if req.data_parallel_rank is not None:
        return req.data_parallel_rank
    # a prefill server serves a room on the prefill rank the router picked
    if limits.disaggregation_mode == "prefill":
        return req.disagg_prefill_dp_rank
    return None


def _refuse(obj, table: dict[str, tuple], prefix: str = "") -> None:
    """A field set to a value pdserve does not implement is a 400 naming it (refused_fields.py)."""
    try:
        refused_fields.check(obj, table, prefix)
    except refused_fields.UnsupportedField as e:
        raise RequestError(str(e), param=e.param, code="unsupported") from None


def _refuse_generate(req: "GenerateRequest") -> None:
    _refuse(req, refused_fields.GENERATE)
    sps = req.sampling_params
    for g in sps if isinstance(sps, list) else [sps] if sps is not None else []:
        _refuse(g, refused_fields.SAMPLING_PARAMS, "sampling_params.")


def _refuse_openai(req, table: dict[str, tuple]) -> None:
    _refuse(req, table)
    if req.stream_options is not None:
        _refuse(req.stream_options, refused_fields.STREAM_OPTIONS, "stream_options.")


def _unsupported(req, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(req, name, None) not in (None, [], {}):
            raise RequestError(f"`{name}` is not supported by pdserve", param=name, code="unsupported")


def _pick(x, i: int):
    return x[i] if isinstance(x, list) else x


def local_prefill_refusal(num_tokens: int, limit: int) -> str:
    """Why a decode server refuses a prompt without bootstrap fields (the HTTP layer answers 400 with it;
    the decode loop checks again)."""
    if limit == 0:
        return "a decode server needs bootstrap_host, bootstrap_port and bootstrap_room"
    return (f"a decode server prefills at most {limit} prompt tokens itself (--max-local-prefill-tokens); "
            f"this prompt has {num_tokens}: send it with bootstrap_host, bootstrap_port and bootstrap_room")


def _bootstraps(req, num_prompts: int, limits: RequestLimits, prefill_rank: int | None) -> list[BootstrapInfo | None]:
    fields_ = (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
    if all(f is None for f in fields_):
        local_ok = limits.disaggregation_mode == "decode" and limits.max_local_prefill_tokens > 0
        if limits.disaggregation_mode != "null" and not local_ok:
            raise RequestError(
                f"a {limits.disaggregation_mode} server needs bootstrap_host, bootstrap_port and bootstrap_room",
                param="bootstrap_room",
            )
        return [None] * num_prompts
    for name, f in zip(("bootstrap_host", "bootstrap_port", "bootstrap_room"), fields_):
        if f is None:
            raise RequestError(f"{name} is missing while other bootstrap fields are given", param=name)
        if isinstance(f, list) and len(f) != num_prompts:
            raise RequestError(f"{name} has {len(f)} entries for {num_prompts} prompts", param=name)
    out = []
    for i in range(num_prompts):
        room = _pick(req.bootstrap_room, i)
        if not 0 <= room < 2**63:
            raise RequestError(f"bootstrap_room must be in [0, 2^63), got {room}", param="bootstrap_room")
        port, host = _pick(req.bootstrap_port, i), _pick(req.bootstrap_host, i)
        if not 0 < port < 65536:
            raise RequestError(f"bootstrap_port must be in [1, 65535], got {port}", param="bootstrap_port")
        # the decode side turns it into a URL: no empty, overlong or whitespace/control-character hosts
        if not host or len(host) > 255 or any(c.isspace() or not c.isprintable() or c in "/?#@" for c in host):
            raise RequestError(f"bootstrap_host must be a host name or address, got {host[:64]!r}",
                               param="bootstrap_host")
        out.append(
            BootstrapInfo(
                host=host,
                port=port,
                room=room,
                prefill_dp_rank=prefill_rank,
            )
        )
    return out


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(s == "" for s in stops):
        raise RequestError("stop strings must not be empty", param="stop")
    return stops


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


def _sglang_grammars(obj) -> dict[str, Any]:
    """SGLang's grammar fields of a body (or its sampling_params), by name."""
    return {name: getattr(obj, name) for name in GRAMMAR_FIELDS}


def _grammar(prefix: str, given: dict[str, Any]) -> dict[str, str]:
    """The one grammar among ``given`` (field name -> value, None: absent) as SamplingParams
    fields, parsed now so that a bad one is a 400 naming its field before anything is scheduled."""
    present = {k: v for k, v in given.items() if v is not None}
    if len(present) > 1:
        a, b = list(present)[:2]
        raise RequestError(f"{b} cannot be combined with {a}: give at most one grammar", param=f"{prefix}{b}")
    if not present:
        return {}
    (name, value), = present.items()
    kind = name if name in GRAMMAR_FIELDS else "json_schema"
    try:
        text = schema_text(name, value) if kind == "json_schema" else value
        check_grammar(kind, text, name)
    except InvalidGrammar as e:
        raise RequestError(f"{prefix}{e}", param=f"{prefix}{e.field}") from None
    return {kind: text}


def _rids(rid: str | list[str] | None, count: int, n: int) -> list[str]:
    """One rid per sequence: the client's (suffixed per choice when n > 1), else fresh."""
    if rid is None:
        base = [new_rid() for _ in range(count)]
    elif isinstance(rid, str):
        if count != 1:
            raise RequestError("rid must be a list with one entry per prompt for a batch", param="rid")
        base = [rid]
    else:
        if len(rid) != count:
            raise RequestError(f"rid has {len(rid)} entries for {count} prompts", param="rid")
        base = list(rid)
    if len(set(base)) != len(base):
        raise RequestError("rid entries must be distinct", param="rid")
    if n == 1:
        return base
    return [f"{b}-{j}" for b in base for j in range(n)]


def _check_n(n: int | None, limits: RequestLimits, param: str = "n") -> int:
    n = 1 if n is None else n
    if not 1 <= n <= limits.max_n:
        raise RequestError(f"{param} must be in [1, {limits.max_n}], got {n}", param=param)
    return n


def _check_max_tokens(value: int | None, param: str, minimum: int) -> None:
    if value is not None and value < minimum:
        raise RequestError(f"{param} must be >= {minimum}, got {value}", param=param)


# --- /generate -------------------------------------------------------------------------------


def generate_sequences(
    req: GenerateRequest, limits: RequestLimits, text_param: str = "text"
) -> tuple[list[SequenceSpec], bool]:
    """Expand a /generate body; returns the sequences and whether the body was a batch.

    ``text_param``: the name errors give the ``text`` field (the offline Engine calls it ``prompt``)."""
    _refuse_generate(req)
    _check_model(req.model, limits)
    if (req.text is None) == (req.input_ids is None):
        raise RequestError(f"exactly one of `{text_param}` and `input_ids` must be given", param=text_param)
    prompts: list[str | list[int]]
    if req.text is not None:
        is_batch = isinstance(req.text, list)
        prompts = list(req.text) if is_batch else [req.text]
        prompt_param = text_param
    else:
        ids = req.input_ids
        if _is_int_list(ids):
            is_batch, prompts = False, [ids]
        elif isinstance(ids, list) and ids and all(_is_int_list(x) for x in ids):
            is_batch, prompts = True, list(ids)
        else:
            raise RequestError("input_ids must be a list of token ids or a list of such lists", param="input_ids")
        for p in prompts:
            _check_ids(p, limits.vocab_size, "input_ids")
        prompt_param = "input_ids"
    if is_batch and not prompts:
        raise RequestError(f"{prompt_param} must not be an empty batch", param=prompt_param)
    for p in prompts:
        if len(p) == 0:
            raise RequestError(f"{prompt_param} must not be empty", param=prompt_param)
    num = len(prompts)

    sps = req.sampling_params
    if isinstance(sps, list):
        if len(sps) != num:
            raise RequestError(f"sampling_params has {len(sps)} entries for {num} prompts", param="sampling_params")
    gsps = [(_pick(sps, i) or GenerateSamplingParams()) for i in range(num)]
    ns = set()
    per_prompt: list[tuple[SamplingParams, bool, bool]] = []
    for g in gsps:
        _unsupported(g, ("structural_tag",))
        n = _check_n(g.n, limits, "sampling_params.n")
        ns.add(n)
        _check_max_tokens(g.max_new_tokens, "sampling_params.max_new_tokens", 0)
        sp = _build_sampling(
            "sampling_params.",
            {},
            max_new_tokens=g.max_new_tokens,
            min_new_tokens=g.min_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            min_p=g.min_p,
            stop=_stop_list(g.stop),
            stop_token_ids=g.stop_token_ids,
            ignore_eos=g.ignore_eos,
            skip_special_tokens=g.skip_special_tokens,
            repetition_penalty=g.repetition_penalty,
            frequency_penalty=g.frequency_penalty,
            presence_penalty=g.presence_penalty,
            seed=g.sampling_seed if g.sampling_seed is not None else g.seed,
            n=1,
            **_grammar("sampling_params.", _sglang_grammars(g)),
        )
        if sp.stop_token_ids:
            _check_ids(sp.stop_token_ids, limits.vocab_size, "sampling_params.stop_token_ids")
        per_prompt.append((sp, g.max_new_tokens is not None, bool(g.no_stop_trim)))
    if len(ns) > 1:
        raise RequestError("sampling_params.n must be the same for every prompt", param="sampling_params.n")
    n = ns.pop()
    is_batch = is_batch or n > 1

    for name in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
        v = getattr(req, name)
        if isinstance(v, list) and len(v) != num:
            raise RequestError(f"{name} has {len(v)} entries for {num} prompts", param=name)
    routed = _check_dp_rank(req, limits)
    boots = _bootstraps(req, num, limits, req.disagg_prefill_dp_rank)
    rids = _rids(req.rid, num, n)
    seqs = []
    for i in range(num):
        sp, given, no_trim = per_prompt[i]
        top_n = _pick(req.top_logprobs_num, i) or 0
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
        start = _pick(req.logprob_start_len, i)
        for j in range(n):
            seqs.append(
                SequenceSpec(
                    index=i * n + j,
                    prompt_index=i,
                    prompt=prompts[i],
                    sampling_params=_with_choice_seed(sp, j),
                    rid=rids[i * n + j],
                    max_tokens_given=True,  # /generate's default is SGLang's 128, not "up to the context"
                    return_logprob=bool(_pick(req.return_logprob, i)),
                    top_logprobs_num=top_n,
                    logprob_start_len=-1 if start is None else start,
                    routed_dp_rank=routed,
                    bootstrap=boots[i],
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


# --- OpenAI ----------------------------------------------------------------------------------


def _openai_sampling(
    req: _OpenAICommon, max_tokens: int | None, max_tokens_param: str, limits: RequestLimits,
    grammars: dict[str, Any] | None = None,
) -> SamplingParams:
    """``grammars``: the grammar fields to check (default SGLang's three on the body)."""
    _unsupported(req, ("logit_bias",))
    if grammars is None:
        grammars = _sglang_grammars(req)
    _check_max_tokens(req.min_tokens, "min_tokens", 0)
    sp = _build_sampling(
        "",
        {"max_new_tokens": max_tokens_param, "min_new_tokens": "min_tokens"},
        max_new_tokens=max_tokens,
        min_new_tokens=req.min_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        stop=_stop_list(req.stop),
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        seed=req.seed,
        n=1,
        **_grammar("", grammars),
    )
    if sp.stop_token_ids:
        _check_ids(sp.stop_token_ids, limits.vocab_size, "stop_token_ids")
    return sp


def _with_model_defaults(req: _OpenAICommon, limits: RequestLimits) -> _OpenAICommon:
    """The request with the model's sampling defaults in the fields it left out (SGLang's
    ``--sampling-defaults model``; only temperature, top_p, top_k, min_p and repetition_penalty)."""
    unset = {k: v for k, v in limits.sampling_defaults.items() if getattr(req, k) is None}
    return msgspec.structs.replace(req, **unset) if unset else req


def _openai_sequences(
    req: _OpenAICommon,
    prompts: list,
    sp: SamplingParams,
    max_tokens_given: bool,
    max_tokens_param: str,
    prompt_param: str,
    limits: RequestLimits,
    return_logprob: bool,
    top_logprobs: int,
    tool_plan: ToolPlan | None = None,
) -> list[SequenceSpec]:
    n = _check_n(req.n, limits)
    routed = _check_dp_rank(req, limits)
    boots = _bootstraps(req, len(prompts), limits, req.disagg_prefill_dp_rank)
    rids = _rids(req.rid, len(prompts), n)
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
                    bootstrap=boots[i],
                    no_stop_trim=bool(req.no_stop_trim),
                    prompt_param=prompt_param,
                    max_tokens_param=max_tokens_param,
                    tool_plan=tool_plan,
                )
            )
    return seqs


def completion_sequences(req: CompletionRequest, limits: RequestLimits) -> list[SequenceSpec]:
    _check_model(req.model, limits)
    _refuse_openai(req, refused_fields.COMPLETIONS)
    if req.echo:
        raise RequestError("`echo` is not supported by pdserve", param="echo", code="unsupported")
    p = req.prompt
    if p is None:
        raise RequestError("`prompt` is required", param="prompt")
    if isinstance(p, str):
        prompts = [p]
    elif _is_int_list(p) and p:
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(_is_int_list(x) for x in p):
        prompts = list(p)
    elif p == []:
        raise RequestError("prompt must not be empty", param="prompt")
    else:
        raise RequestError("prompt must be a string, a list of strings, or token ids", param="prompt")
    for x in prompts:
        if len(x) == 0:
            raise RequestError("prompt must not be empty", param="prompt")
        if isinstance(x, list):
            _check_ids(x, limits.vocab_size, "prompt")
    n = req.n if req.n is not None else 1
    if req.best_of is not None and req.best_of != n:
        raise RequestError("best_of other than n is not supported by pdserve", param="best_of", code="unsupported")
    _check_max_tokens(req.max_tokens, "max_tokens", 1)
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


def _response_format_schema(rf: Any) -> tuple[str, Any] | None:
    """(field name, JSON schema) that ``response_format`` holds the output to; None for text."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if rf is None or kind == "text":
        return None
    if kind == "json_object":
        return "response_format", JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("response_format json_schema needs json_schema.schema",
                               param="response_format.json_schema")
        return "response_format.json_schema.schema", spec["schema"]
    raise RequestError("response_format.type must be text, json_object or json_schema", param="response_format.type")


def chat_sequences(req: ChatCompletionRequest, limits: RequestLimits) -> list[SequenceSpec]:
    _check_model(req.model, limits)
    _unsupported(req, ("functions", "audio", "prediction"))
    try:
        tools = tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls, limits.tool_call_parser)
    except ToolRequestError as e:
        raise RequestError(str(e), param=e.param) from None
    grammars = _sglang_grammars(req)
    rf = _response_format_schema(req.response_format)
    if rf is not None:
        grammars[rf[0]] = rf[1]
    if tools.json_schema is not None:
        grammars["tools"] = tools.json_schema
    if not req.messages:
        raise RequestError("messages must not be empty", param="messages")
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
    if all(not m["content"] for m in messages):
        raise RequestError("messages must not all be empty", param="messages")
    _check_max_tokens(req.max_tokens, "max_tokens", 1)
    _check_max_tokens(req.max_completion_tokens, "max_completion_tokens", 1)
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
    _refuse_openai(req, refused_fields.CHAT)
    req = _with_model_defaults(req, limits)
    sp = _openai_sampling(req, max_tokens, param, limits, grammars)
    template_kwargs = dict(req.chat_template_kwargs or {})
    if tools.template_tools:
        template_kwargs["tools"] = tools.template_tools
    prompt = ChatPrompt(messages, bool(req.continue_final_message), template_kwargs)
    return _openai_sequences(
        req, [prompt], sp, max_tokens is not None, param, "messages", limits, bool(req.logprobs), top or 0,
        tools.plan,
    )


def include_usage(req: _OpenAICommon) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
