"""The PD request rules: which requests a server of each disaggregation mode takes without a KV peer.

A prefill or decode server serves a request with bootstrap fields (the room its KV crosses);
without them only a colocated server serves it, or a decode server that prefills short prompts
itself (``--max-local-prefill-tokens``). The HTTP layer answers 400 with these messages and the
decode loop checks again, so both say the same.

``sequence_room`` is the rule by which both sides of a pair find the room of each sequence of a
request that expands (``n`` > 1, a batch): the router sends the request's rooms once, and the
prefill and the decode server derive the same room per sequence from them.
"""

from __future__ import annotations


def bootstrap_refusal(disaggregation_mode: str, max_local_prefill_tokens: int) -> str | None:
    """Why a server of this mode refuses every request without bootstrap fields; None: it takes them."""
    local_ok = disaggregation_mode == "decode" and max_local_prefill_tokens > 0
    if disaggregation_mode != "null" and not local_ok:
        return f"a {disaggregation_mode} server needs bootstrap_host, bootstrap_port and bootstrap_room"
    return None


def local_prefill_refusal(num_tokens: int, limit: int) -> str:
    """Why a decode server refuses a prompt without bootstrap fields (the HTTP layer answers 400 with it;
    the decode loop checks again)."""
    if limit == 0:
        return bootstrap_refusal("decode", 0)
    return (f"a decode server prefills at most {limit} prompt tokens itself (--max-local-prefill-tokens); "
            f"this prompt has {num_tokens}: send it with bootstrap_host, bootstrap_port and bootstrap_room")


ROOM_SPACE = 2**63  # rooms are below 2^63 (SGLang's range)


def sequence_room(rooms: int | list[int], prompt: int, choice: int, num_prompts: int) -> int:
    """The room of choice ``choice`` of prompt ``prompt`` (of ``num_prompts``) of one request.

    A list gives choice 0 of each prompt its room; choice j of prompt i has ``rooms[i] + j *
    num_prompts``. One int ``r`` stands for the list ``[r, r + 1, ..., r + num_prompts - 1]``, so
    sequence k of SGLang's expanded order (``k = j * num_prompts + i``) has room ``r + k``, as
    SGLang's servers number it. Sums wrap below 2^63.
    """
    base = rooms[prompt] if isinstance(rooms, list) else rooms + prompt
    return (base + choice * num_prompts) % ROOM_SPACE
