"""The PD request rules: which requests a server of each disaggregation mode takes without a KV peer.

A prefill or decode server serves a request with bootstrap fields (the room its KV crosses);
without them only a colocated server serves it, or a decode server that prefills short prompts
itself (``--max-local-prefill-tokens``). The HTTP layer answers 400 with these messages and the
decode loop checks again, so both say the same.
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
