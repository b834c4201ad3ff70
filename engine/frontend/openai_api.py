"""Response shaping: SGLang's /generate objects, OpenAI's completion and chat
objects and stream chunks, and SSE framing.

Pure functions of a sequence's state (``SeqState``) and its latest ``Delta``;
no I/O. ``tok_str`` turns a token id into its text for logprob entries.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import msgspec

from pdserve.engine.frontend.chat_choice import whole_choice
from pdserve.engine.frontend.seq_state import Delta, SeqState

SSE_DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()

TokStr = Callable[[int], str]


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def error_object(message: str, type: str = "server_error", param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(states: list[SeqState], prompt_states: list[SeqState] | None = None) -> dict:
    """OpenAI usage; prompt tokens counted once per prompt (not per choice)."""
    prompts = {}
    for s in prompt_states or states:
        prompts.setdefault(s.spec.prompt_index, (s.prompt_tokens, s.cached_tokens))
    prompt_tokens = sum(p for p, _ in prompts.values())
    cached = sum(c for _, c in prompts.values())
    completion = sum(s.completion_tokens for s in states)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def openai_finish_reason(st: SeqState) -> str | None:
    if st.finish_reason is None:
        return None
    return st.finish_reason if st.finish_reason in ("stop", "length") else "abort"


# --- SGLang /generate ------------------------------------------------------------------------


def _sgl_finish(st: SeqState, length_detail: bool) -> dict | None:
    if st.finish_reason is None:
        return None
    d: dict[str, Any] = {"type": st.finish_reason}
    if st.finish_reason == "stop" and st.matched_stop is not None:
        d["matched"] = st.matched_stop
    elif st.finish_reason == "length" and length_detail:
        d["length"] = st.completion_tokens
    if st.error:
        d["message"] = st.error
    return d


def _sgl_logprob_entries(entries, tok_str: TokStr | None) -> list:
    # SGLang's shape: [logprob, token_id, text or None]
    return [[lp, tid, tok_str(tid) if tok_str else None] for tid, lp in entries]


def generate_object(
    st: SeqState, tok_str: TokStr | None = None, delta: Delta | None = None, length_detail: bool = True
) -> dict:
    """One /generate output: text, ids and logprobs so far (a response, or an event of an HTTP
    stream), or with ``delta`` only what it added (a stream chunk under ``incremental_streaming_output``).

    ``length_detail``: SGLang's ``finish_reason`` of a length stop carries the length; the offline
    Engine's has the type alone."""
    meta: dict[str, Any] = {
        "id": st.rid,
        "finish_reason": _sgl_finish(st, length_detail),
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens,
        "cached_tokens": st.cached_tokens,
        "e2e_latency": st.e2e_latency(),
    }
    if st.spec.return_logprob:
        logprobs = st.logprobs if delta is None else delta.logprobs
        meta["output_token_logprobs"] = _sgl_logprob_entries([(t.token_id, t.logprob) for t in logprobs], tok_str)
        if st.spec.top_logprobs_num:
            meta["output_top_logprobs"] = [_sgl_logprob_entries(t.top, tok_str) for t in logprobs]
        if st.input_logprobs:
            ids = st.input_ids[len(st.input_ids) - len(st.input_logprobs) :]
            meta["input_token_logprobs"] = _sgl_logprob_entries(list(zip(ids, st.input_logprobs)), tok_str)
    if st.spec_verify_ct is not None:  # SGLang's names; accept length: tokens gained per verify step
        meta["spec_verify_ct"] = st.spec_verify_ct
        meta["spec_draft_token_num"] = st.spec_draft_token_num
        meta["spec_accept_token_num"] = st.spec_accept_token_num
        if st.spec_verify_ct:
            meta["spec_accept_length"] = (st.spec_accept_token_num + st.spec_verify_ct) / st.spec_verify_ct
    if st.dp_rank is not None:
        meta["dp_rank"] = st.dp_rank
    if delta is None:
        out = {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}
    else:
        out = {"text": delta.text, "output_ids": list(delta.token_ids), "meta_info": meta}
    if st.num_prompts_in_batch:
        out["index"] = st.spec.index
    return out


# --- OpenAI /v1/completions ------------------------------------------------------------------


def _completion_logprobs(entries, tok_str: TokStr, offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        s = tok_str(e.token_id)
        tokens.append(s)
        token_logprobs.append(e.logprob)
        top.append({tok_str(t): lp for t, lp in e.top} if e.top else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def completion_object(rid: str, model: str, created: int, states: list[SeqState], tok_str: TokStr) -> dict:
    choices = []
    for st in states:
        choices.append(
            {
                "index": st.spec.index,
                "text": st.text,
                "logprobs": _completion_logprobs(st.logprobs, tok_str, 0) if st.spec.return_logprob else None,
                "finish_reason": openai_finish_reason(st),
                "matched_stop": st.matched_stop,
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(states),
    }


def completion_chunk(rid: str, model: str, created: int, st: SeqState, d: Delta, tok_str: TokStr) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": st.spec.index,
                "text": d.text,
                "logprobs": _completion_logprobs(d.logprobs, tok_str, len(st.text) - len(d.text))
                if st.spec.return_logprob
                else None,
                "finish_reason": openai_finish_reason(st) if d.finished else None,
                "matched_stop": st.matched_stop if d.finished else None,
            }
        ],
    }


# --- OpenAI /v1/chat/completions -------------------------------------------------------------


def _chat_logprobs(entries, tok_str: TokStr) -> dict:
    content = []
    for e in entries:
        s = tok_str(e.token_id)
        content.append(
            {
                "token": s,
                "logprob": e.logprob,
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": tok_str(t), "logprob": lp, "bytes": list(tok_str(t).encode("utf-8"))} for t, lp in e.top
                ],
            }
        )
    return {"content": content}


def _chat_finish_reason(st: SeqState, made_tool_calls: bool) -> str | None:
    reason = openai_finish_reason(st)
    return "tool_calls" if made_tool_calls and reason == "stop" else reason


def chat_object(rid: str, model: str, created: int, states: list[SeqState], tok_str: TokStr) -> dict:
    choices = []
    for st in states:
        thought, content, calls = whole_choice(st.text, st.spec.reasoning, st.spec.tool_plan)
        choices.append(
            {
                "index": st.spec.index,
                "message": {"role": "assistant", "content": content, "reasoning_content": thought,
                            "tool_calls": [c.to_dict() for c in calls] or None},
                "logprobs": _chat_logprobs(st.logprobs, tok_str) if st.spec.return_logprob else None,
                "finish_reason": _chat_finish_reason(st, bool(calls)),
                "matched_stop": st.matched_stop,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(states),
    }


def chat_chunk(rid: str, model: str, created: int, st: SeqState, d: Delta | None, tok_str: TokStr) -> dict:
    """A chat stream chunk; ``d`` None is the opening chunk carrying the role."""
    if d is None:
        delta: dict[str, Any] = {"role": "assistant", "content": ""}
        choice = {"index": st.spec.index, "delta": delta, "logprobs": None, "finish_reason": None}
    else:
        choice = {
            "index": st.spec.index,
            "delta": {"content": d.text} if d.text or not d.finished else {},
            "logprobs": _chat_logprobs(d.logprobs, tok_str) if st.spec.return_logprob else None,
            "finish_reason": openai_finish_reason(st) if d.finished else None,
        }
        if d.finished:
            choice["matched_stop"] = st.matched_stop
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def chat_tool_chunks(rid: str, model: str, created: int, st: SeqState, deltas: list[dict], finished: bool,
                     made_tool_calls: bool) -> list[dict]:
    """The chunks of a choice with tools or reasoning: one per delta (``ChatChoiceStream.feed``), then the
    closing one."""
    def chunk(delta: dict, finish_reason: str | None) -> dict:
        choice = {"index": st.spec.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}

    out = [chunk(d, None) for d in deltas]
    if finished:
        out.append(chunk({}, _chat_finish_reason(st, made_tool_calls)))
    return out


def with_token_ids(obj: dict, states: list[SeqState], chat: bool) -> None:
    """A whole answer with ``return_token_ids`` (vLLM's shape): each choice's ``token_ids``, the prompt's
    ``prompt_token_ids`` on each completion choice, or once at the top of a chat answer."""
    for choice, st in zip(obj["choices"], states):
        choice["token_ids"] = list(st.output_ids)
        if not chat:
            choice["prompt_token_ids"] = list(st.input_ids)
    if chat and states:
        obj["prompt_token_ids"] = list(states[0].input_ids)


def usage_chunk(rid: str, model: str, created: int, object_: str, states: list[SeqState]) -> dict:
    return {"id": rid, "object": object_, "created": created, "model": model, "choices": [], "usage": usage(states)}


def now() -> int:
    return int(time.time())
