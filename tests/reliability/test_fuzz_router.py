"""Property test: random request bodies against the router in front of a real 1P1D pair.

Bodies mix the real field names of the three APIs with values of every JSON type, small valid
ones and wild ones. Each answer is a 200 (then the body is complete) or a 4xx JSON error; never a
5xx, a hang or a dead process; afterwards every page is free on both sides.
"""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(300)

SMALL_INT = st.integers(-2, 4)
WILD_INT = st.sampled_from([-(2**63), -1, 2**31, 2**63, 10**30])
FLOAT = st.floats(allow_nan=False, allow_infinity=False, width=32) | st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.5])
TEXT = st.text(max_size=12) | st.sampled_from(["", "Hello", "\u0000", "\ud7ff" * 3, "<|im_start|>"])
LEAF = st.none() | st.booleans() | SMALL_INT | WILD_INT | FLOAT | TEXT
JSONV = st.recursive(LEAF, lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=6)

SAMPLING_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                 "ignore_eos", "n", "frequency_penalty", "presence_penalty", "repetition_penalty", "seed",
                 "min_new_tokens", "skip_special_tokens", "max_token"]
TOP_KEYS = ["text", "input_ids", "prompt", "messages", "model", "max_tokens", "max_completion_tokens",
            "temperature", "stream", "n", "logprobs", "top_logprobs", "echo", "stop", "return_logprob",
            "logprob_start_len", "top_logprobs_num", "rid", "bootstrap_room", "bootstrap_host", "stream_options",
            "seed", "user", "suffix", "unknown_field"]


def _value(key: str):
    if key in ("max_new_tokens", "max_tokens", "max_completion_tokens", "n"):
        return SMALL_INT | WILD_INT | TEXT  # never a valid large count: keeps generations short
    if key == "input_ids":
        return st.lists(st.integers(-5, 60000), max_size=8) | JSONV
    if key == "messages":
        msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                     "content": TEXT | JSONV})
        return st.lists(msg, max_size=3) | JSONV
    return JSONV


BASES = {
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"model": "default", "prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
}


@st.composite
def requests_(draw):
    """(path, body): a valid body with a few fields mutated, or (a third of the time) one built from scratch."""
    path = draw(st.sampled_from(sorted(BASES)))
    body = json.loads(json.dumps(BASES[path])) if draw(st.integers(0, 2)) else {}
    for key in draw(st.lists(st.sampled_from(TOP_KEYS), max_size=3, unique=True)):
        body[key] = draw(_value(key))
    if draw(st.booleans()):
        sp = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}
        for k in draw(st.lists(st.sampled_from(SAMPLING_KEYS), max_size=3, unique=True)):
            sp[k] = draw(_value(k))
        body["sampling_params"] = sp
    # keep valid generations short whatever else was drawn
    if path == "/generate":
        if isinstance(body.get("sampling_params"), dict):
            body["sampling_params"].setdefault("max_new_tokens", 2)
    else:
        body.setdefault("max_tokens", 2)
    return path, body


def test_router_answers_random_bodies_with_200_or_4xx_json(pd11):
    P, D, R = pd11
    seen: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(req=requests_())
    def prop(req):
        path, body = req
        raw = json.dumps(body).encode()
        r = requests.post(R.url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code == 200 or 400 <= r.status_code < 500, (path, body, r.status_code, r.text[:500])
        if r.status_code != 200:
            assert "error" in r.json(), r.text[:500]

    prop()
    for s in (P, D, R):
        assert s.proc.poll() is None, s.log()
    assert sum(seen.values()) >= 60 and any(400 <= c < 500 for c in seen) and seen.get(200, 0) >= 2, seen
    P.wait_unleaked()
    D.wait_unleaked()
