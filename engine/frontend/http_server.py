"""The engine server's HTTP API (aiohttp): SGLang's and OpenAI's endpoints.

Handlers decode and validate the body (``request_schemas``, ``value_checks``, ``sequences``), hand the sequences to the
tokenizer manager, and shape what comes back (``openai_api``). Every error
leaves as OpenAI's error object. A middleware checks the API key (the admin key and the
method of control routes: ``control_access``) and the body size and counts requests for /metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

import msgspec
from aiohttp import web

from pdserve.engine.frontend import control_api
from pdserve.engine.frontend import openai_api as api
from pdserve.engine.frontend import tokenize_api
from pdserve.engine.frontend.control_access import CONTROL_PATHS, check_control
from pdserve.engine.frontend.drain import DRAIN_KEY, Drain, drain_middleware
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.frontend.request_error import RequestError, decode_body
from pdserve.engine.frontend.request_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    include_usage,
)
from pdserve.engine.frontend.sequences import (
    SequenceSpec,
    chat_sequences,
    completion_sequences,
    generate_sequences,
)
from pdserve.engine.frontend.value_checks import MAX_BATCH_PROMPTS, new_rid
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.frontend.seq_state import SeqState
from pdserve.engine.frontend.chat_choice import ChatChoiceStream
from pdserve.engine.server_config import ServerConfig
from pdserve.engine.frontend.request_trace import trace_middleware
from pdserve.engine.frontend.tokenizer_manager import MAX_CHARS_PER_TOKEN, RequestHandle, TokenizerManager

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key needed
_json = msgspec.json.Encoder()
TM_KEY = web.AppKey("tokenizer_manager", TokenizerManager)
CONFIG_KEY = web.AppKey("server_config", ServerConfig)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
STARTED_KEY = web.AppKey("started", float)
HEALTH_GENERATE_TIMEOUT = 30.0


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(obj), status=status, content_type="application/json")


def error_response(err: RequestError) -> web.Response:
    return json_response(err.to_dict(), status=err.status)


async def read_body(request: web.Request) -> bytes:
    limit = request.app[CONFIG_KEY].max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise RequestError(
            f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes",
            status=413,
            code="request_too_large",
        )
    timeout = request.app[CONFIG_KEY].http_read_timeout
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise RequestError(f"the request body did not arrive within --http-read-timeout ({timeout:g} s)",
                           status=408, code="request_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(f"request body exceeds the limit of {limit} bytes", status=413, code="request_too_large")


@web.middleware
async def api_middleware(request: web.Request, handler):
    config = request.app[CONFIG_KEY]
    metrics = request.app[METRICS_KEY]
    status = 500
    try:
        if request.path in CONTROL_PATHS:
            check_control(request, config.admin_api_key)
        elif config.api_key is not None and request.path not in OPEN_PATHS:
            auth = request.headers.get("Authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {config.api_key}".encode()):
                raise RequestError("invalid or missing API key", status=401, type="authentication_error", code="invalid_api_key")
        resp = await handler(request)
        status = resp.status
        return resp
    except RequestError as e:
        status = e.status
        return error_response(e)
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return json_response(api.error_object(f"{e.reason}: {request.method} {request.path}", kind), e.status)
    except (ConnectionResetError, asyncio.CancelledError):
        status = 499  # the client went away
        raise
    except Exception as e:  # a bug: answer 500 instead of dropping the connection
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return json_response(api.error_object(f"internal error: {e!r}"), 500)
    finally:
        metrics.on_http(request.path if request.match_info.route.resource else "other", status)


# --- helpers -----------------------------------------------------------------------------------


def _first_error(states: list[SeqState]) -> RequestError | None:
    for st in states:
        if st.finish_reason == "error":
            status = st.error_status
            return RequestError(
                st.error or "generation failed",
                status=status,
                type="server_error",
                code="unavailable" if status == 503 else "generation_error",
            )
    return None


def _error_event(st: SeqState) -> bytes:
    return api.sse(api.error_object(st.error or "generation failed", code=st.error_status))


async def _start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    return resp


def _timeout_error(timeout: float) -> RequestError:
    return RequestError(f"the request ran past --request-timeout ({timeout:g} s); its sequences were aborted",
                        status=504, type="server_error", code="request_timeout")


async def _stream(request: web.Request, handle: RequestHandle, render, tail=lambda: b"") -> web.StreamResponse:
    """Write SSE events as updates arrive; ``render(state, delta) -> bytes`` shapes each one. Past
    ``--request-timeout`` the stream ends with an error event and the sequences are aborted."""
    timeout = request.app[CONFIG_KEY].request_timeout
    try:
        # inside the try: a client gone before the headers went out must still abort its request
        resp = await _start_sse(request)
        try:
            async with asyncio.timeout(timeout):
                async for first in handle:
                    chunks = []
                    for st, d in [first] + handle.drain_nowait():
                        if d.finished and st.finish_reason == "error":
                            chunks.append(_error_event(st))
                        else:
                            chunks.append(render(st, d))
                    data = b"".join(chunks)
                    if data:
                        await resp.write(data)
        except TimeoutError:
            err = _timeout_error(timeout)
            await resp.write(api.sse(api.error_object(err.message, code=err.status)) + api.SSE_DONE)
            return resp
        if _first_error(handle.states) is None:
            await resp.write(tail())
        await resp.write(api.SSE_DONE)
    finally:
        handle.close()
    return resp


async def _collect(request: web.Request, handle: RequestHandle) -> list[SeqState]:
    """Every sequence's final state; past ``--request-timeout`` a 504 (the sequences aborted)."""
    timeout = request.app[CONFIG_KEY].request_timeout
    try:
        async with asyncio.timeout(timeout):
            return await handle.wait_all()
    except TimeoutError:
        raise _timeout_error(timeout) from None
    finally:
        handle.close()


# --- generation endpoints ----------------------------------------------------------------------


async def generate(request: web.Request) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    req = decode_body(await read_body(request), GenerateRequest)
    seqs, is_batch = generate_sequences(req, tm.limits())
    handle = await tm.submit_async(seqs, batch=is_batch)
    tok_str = tm.token_str if req.return_text_in_logprobs else None
    if req.stream:

        incremental = tm.config.incremental_streaming_output

        def render(st: SeqState, d) -> bytes:
            return api.sse(api.generate_object(st, tok_str, delta=d if incremental else None))

        return await _stream(request, handle, render)
    states = await _collect(request, handle)
    err = _first_error(states)
    if err is not None:
        raise err
    outs = [api.generate_object(st, tok_str) for st in states]
    return json_response(outs if is_batch else outs[0])


async def completions(request: web.Request) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    req = decode_body(await read_body(request), CompletionRequest)
    handle = await tm.submit_async(completion_sequences(req, tm.limits()))
    return await _openai(request, tm, req, handle, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    tm = request.app[TM_KEY]
    req = decode_body(await read_body(request), ChatCompletionRequest)
    handle = await tm.submit_async(chat_sequences(req, tm.limits()))
    return await _openai(request, tm, req, handle, chat=True)


async def _openai(request, tm: TokenizerManager, req, handle: RequestHandle, chat: bool) -> web.StreamResponse:
    rid = ("chatcmpl-" if chat else "cmpl-") + (req.rid if isinstance(req.rid, str) else new_rid())
    model = req.model or tm.config.model_name
    created = api.now()
    if not req.stream:
        states = await _collect(request, handle)
        err = _first_error(states)
        if err is not None:
            raise err
        shape = api.chat_object if chat else api.completion_object
        obj = shape(rid, model, created, states, tm.token_str)
        if req.return_token_ids:
            api.with_token_ids(obj, states, chat)
        return json_response(obj)

    opened: set[int] = set()
    parts_streams: dict[int, ChatChoiceStream] = {}
    ids_out = bool(req.return_token_ids)

    def render(st: SeqState, d) -> bytes:
        out = b""
        first = st.spec.index not in opened
        opened.add(st.spec.index)
        if chat and first:
            chunk = api.chat_chunk(rid, model, created, st, None, tm.token_str)
            if ids_out:
                chunk["prompt_token_ids"] = list(st.input_ids)
            out += api.sse(chunk)
        if st.spec.tool_plan is not None or st.spec.reasoning is not None:
            ts = parts_streams.setdefault(st.spec.index, ChatChoiceStream(st.spec.reasoning, st.spec.tool_plan))
            deltas = ts.feed(d.text, d.finished)
            chunks = api.chat_tool_chunks(rid, model, created, st, deltas, d.finished, ts.num_calls > 0)
            return out + b"".join(map(api.sse, chunks))
        # a delta of held-back text (a character's first bytes) still carries its ids when asked
        if not d.text and not d.finished and not d.logprobs and not (ids_out and d.token_ids):
            return out
        if chat:
            chunk = api.chat_chunk(rid, model, created, st, d, tm.token_str)
        else:
            chunk = api.completion_chunk(rid, model, created, st, d, tm.token_str)
        if ids_out:
            chunk["choices"][0]["token_ids"] = list(d.token_ids)
            if first and not chat:
                chunk["choices"][0]["prompt_token_ids"] = list(st.input_ids)
        return out + api.sse(chunk)

    def tail() -> bytes:
        if not include_usage(req):
            return b""
        object_ = "chat.completion.chunk" if chat else "text_completion"
        return api.sse(api.usage_chunk(rid, model, created, object_, handle.states))

    return await _stream(request, handle, render, tail)


# --- control and info endpoints ----------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    if tm.dead_reason is not None:
        return json_response(api.error_object(tm.dead_reason, code="unavailable"), 503)
    timeout = request.app[CONFIG_KEY].health_scheduler_timeout
    stalled = tm.stalled_ranks(timeout)
    if stalled:
        names = ", ".join(f"DP rank {r} ({silent:.0f} s)" for r, silent in stalled)
        return json_response(api.error_object(f"scheduler not stepping with requests waiting: {names}; "
                                              f"--health-scheduler-timeout is {timeout:g} s", code="unavailable"), 503)
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    """A one-token greedy generation on every DP rank; prefill and decode servers run it locally,
    without a KV peer (``SequenceSpec.health_probe``)."""
    tm = request.app[TM_KEY]
    if tm.dead_reason is not None:
        return json_response(api.error_object(tm.dead_reason, code="unavailable"), 503)
    seqs = [
        SequenceSpec(
            index=r,
            prompt_index=r,
            prompt=[0],
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
            rid=f"health-{new_rid()}",
            max_tokens_given=True,
            routed_dp_rank=r,
            health_probe=True,
        )
        for r in range(tm.dp_size)
    ]
    handle = tm.submit(seqs, batch=True)
    try:
        states = await asyncio.wait_for(handle.wait_all(), HEALTH_GENERATE_TIMEOUT)
    except asyncio.TimeoutError:
        return json_response(api.error_object("health generation timed out", code="unavailable"), 503)
    finally:
        handle.close()
    err = _first_error(states)
    if err is not None:
        return json_response(err.to_dict(), 503)
    return web.Response(text="")


async def models(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    c = tm.config
    card = {
        "id": c.model_name,
        "object": "model",
        "created": int(request.app[STARTED_KEY]),
        "owned_by": "pdserve",
        "root": c.engine.model_path or c.model_name,
        "max_model_len": tm.model_info.max_context_len,
    }
    # each LoRA adapter is a model of its own, its parent the base (vLLM's cards; SGLang lists them too)
    adapters = [{**card, "id": name, "root": path, "parent": c.model_name} for name, path in tm.lora_paths.items()]
    return json_response({"object": "list", "data": [card, *adapters]})


async def model_info(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    c = tm.config
    return json_response(
        {
            "model_path": c.engine.model_path or c.model_name,
            "tokenizer_path": c.engine.tokenizer_path or c.engine.model_path or c.model_name,
            "served_model_name": c.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "max_context_len": tm.model_info.max_context_len,
            "vocab_size": tm.model_info.vocab_size,
        }
    )


async def server_info(request: web.Request) -> web.Response:
    return json_response(control_api.server_info(request.app[TM_KEY]))


async def metrics_endpoint(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    text = request.app[METRICS_KEY].render(tm.stats, tm.inflight, tm.rank_metrics)
    return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def abort_request(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    body = await read_body(request)
    try:
        obj = msgspec.json.decode(body) if body else {}
    except msgspec.DecodeError as e:
        raise RequestError(f"Invalid JSON body: {e}", code="invalid_json")
    if not isinstance(obj, dict):
        raise RequestError("body must be a JSON object", param=None)
    rid = obj.get("rid")
    if obj.get("abort_all"):
        count = tm.abort_all()
    elif isinstance(rid, str) and rid:
        count = tm.abort(rid)
    else:
        raise RequestError("rid must be a non-empty string (or abort_all true)", param="rid")
    return json_response({"aborted": count})


async def tokenize(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    req = decode_body(await read_body(request), tokenize_api.TokenizeRequest)
    tm.limits().check_model(req.model)
    ctx = tm.model_info.max_context_len
    tokenize_api.check_tokenize(req, ctx * MAX_CHARS_PER_TOKEN, MAX_BATCH_PROMPTS)
    return json_response(await tm.in_tokenizer_thread(tokenize_api.tokenize, tm.tokenizer, req, ctx))


async def detokenize(request: web.Request) -> web.Response:
    tm = request.app[TM_KEY]
    req = decode_body(await read_body(request), tokenize_api.DetokenizeRequest)
    tm.limits().check_model(req.model)
    vocab = tm.model_info.vocab_size
    return json_response(await tm.in_tokenizer_thread(tokenize_api.detokenize, tm.tokenizer, req, vocab))


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's answer: 200 when flushed, 400 when a rank had requests running or waiting."""
    answer = await control_api.flush_cache(request.app[TM_KEY])
    if not answer.success:
        raise RequestError(f"Cache not flushed: {answer.message}", code="not_idle")
    return web.Response(text="Cache flushed.\n")


async def _control_body(request: web.Request, type_):
    """The body of a control endpoint (an empty body: the struct's defaults)."""
    body = await read_body(request)
    return decode_body(body or b"{}", type_)


def _control_response(answer: control_api.ControlAnswer) -> web.Response:
    """SGLang's shape: {"success", "message"}, 200 or 400."""
    return json_response({"success": answer.success, "message": answer.message}, 200 if answer.success else 400)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    inp = await _control_body(request, control_api.UpdateWeightsFromDiskInput)
    answer = await control_api.update_weights_from_disk(request.app[TM_KEY], inp)
    return json_response({"success": answer.success, "message": answer.message, "num_paused_requests": 0},
                         200 if answer.success else 400)


async def get_weights_by_name(request: web.Request) -> web.Response:
    inp = await _control_body(request, control_api.GetWeightsByNameInput)
    answer = await control_api.get_weights_by_name(request.app[TM_KEY], inp)
    if not answer.success:
        raise RequestError(f"Get parameter by name failed: {answer.message}", param="name")
    return json_response(answer.data)


async def release_memory_occupation(request: web.Request) -> web.Response:
    inp = await _control_body(request, control_api.MemoryOccupationInput)
    return _control_response(await control_api.release_memory_occupation(request.app[TM_KEY], inp))


async def resume_memory_occupation(request: web.Request) -> web.Response:
    inp = await _control_body(request, control_api.MemoryOccupationInput)
    return _control_response(await control_api.resume_memory_occupation(request.app[TM_KEY], inp))


async def start_profile(request: web.Request) -> web.Response:
    inp = await _control_body(request, control_api.ProfileInput)
    answer = await control_api.start_profile(request.app[TM_KEY], inp, confined=True)
    if not answer.success:
        raise RequestError(f"Start profiling failed: {answer.message}")
    return web.Response(text="Start profiling.\n")


async def stop_profile(request: web.Request) -> web.Response:
    answer = await control_api.stop_profile(request.app[TM_KEY])
    if not answer.success:
        raise RequestError(f"Stop profiling failed: {answer.message}")
    return web.Response(text=f"Stop profiling. {answer.message}\n")


async def start_expert_distribution_record(request: web.Request) -> web.Response:
    await _control_body(request, control_api.EmptyInput)
    return _control_response(await control_api.start_expert_distribution_record(request.app[TM_KEY]))


async def stop_expert_distribution_record(request: web.Request) -> web.Response:
    await _control_body(request, control_api.EmptyInput)
    return _control_response(await control_api.stop_expert_distribution_record(request.app[TM_KEY]))


async def dump_expert_distribution_record(request: web.Request) -> web.Response:
    """{"success", "message", "logical_count": [num_layers][num_experts]} (SGLang writes the same
    counts to a file on the server; here they come back in the answer)."""
    await _control_body(request, control_api.EmptyInput)
    answer = await control_api.dump_expert_distribution_record(request.app[TM_KEY])
    if not answer.success:
        raise RequestError(f"Dump expert distribution failed: {answer.message}")
    return json_response({"success": True, "message": answer.message, "logical_count": answer.data})


def _lora_response(answer: control_api.ControlAnswer) -> web.Response:
    """SGLang's shape: {"success", "error_message", "loaded_adapters"}, 200 or 400."""
    return json_response({"success": answer.success, "error_message": "" if answer.success else answer.message,
                          "message": answer.message, "loaded_adapters": answer.data}, 200 if answer.success else 400)


async def load_lora_adapter(request: web.Request) -> web.Response:
    inp = await _control_body(request, control_api.LoadLoraAdapterInput)
    return _lora_response(await control_api.load_lora_adapter(request.app[TM_KEY], inp))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    inp = await _control_body(request, control_api.UnloadLoraAdapterInput)
    return _lora_response(await control_api.unload_lora_adapter(request.app[TM_KEY], inp))


def build_app(tm: TokenizerManager, config: ServerConfig, metrics: ServerMetrics, drain: Drain) -> web.Application:
    # the body limit is enforced in read_body with a clear error; aiohttp's own limit sits above it
    middlewares = [api_middleware, drain_middleware]
    if tm.tracer is not None:
        middlewares.append(trace_middleware(tm.tracer, config.disaggregation_mode))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_request_bytes + 1)
    app[DRAIN_KEY] = drain
    app[TM_KEY] = tm
    app[CONFIG_KEY] = config
    app[METRICS_KEY] = metrics
    app[STARTED_KEY] = time.time()
    app.add_routes(
        [
            web.post("/generate", generate),
            web.post("/v1/completions", completions),
            web.post("/v1/chat/completions", chat_completions),
            web.get("/v1/models", models),
            web.get("/health", health),
            web.get("/health_generate", health_generate),
            web.get("/get_model_info", model_info),
            web.get("/model_info", model_info),
            web.get("/get_server_info", server_info),
            web.get("/server_info", server_info),
            web.post("/abort_request", abort_request),
            web.post("/tokenize", tokenize),
            web.post("/v1/tokenize", tokenize),
            web.post("/detokenize", detokenize),
            web.post("/v1/detokenize", detokenize),
            web.post("/flush_cache", flush_cache),
            web.post("/update_weights_from_disk", update_weights_from_disk),
            web.post("/get_weights_by_name", get_weights_by_name),
            web.post("/release_memory_occupation", release_memory_occupation),
            web.post("/resume_memory_occupation", resume_memory_occupation),
            web.post("/start_profile", start_profile),
            web.post("/stop_profile", stop_profile),
            web.post("/start_expert_distribution_record", start_expert_distribution_record),
            web.post("/stop_expert_distribution_record", stop_expert_distribution_record),
            web.post("/dump_expert_distribution_record", dump_expert_distribution_record),
            web.post("/load_lora_adapter", load_lora_adapter),
            web.post("/unload_lora_adapter", unload_lora_adapter),
        ]
    )
    if config.enable_metrics:
        app.add_routes([web.get("/metrics", metrics_endpoint)])
    return app
