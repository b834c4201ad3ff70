"""Speculation through a real 1 prefill + 1 decode deployment behind the router.

Stand, on a tiny random llama (fp32, 64-token chunks, ``tests/support/pd_stand.py``'s servers over the
Mooncake TCP transfer on loopback): a prefill server given ``--speculative-algorithm NGRAM`` (which
it ignores, saying so), a decode server that speculates with NGRAM, the pdserve router in front of
them, and a plain colocated server as the reference. Greedy outputs through the router (SGLang's
``/generate``, completions and chat, streamed and not, a stop string and max_tokens cut inside
accepted runs) are the colocated server's token for token, the decode really verified and accepted
drafts, and both servers' pools are unleaked afterwards; a client that leaves a speculating stream
frees its pages on both sides.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import requests
from support.model_util import make_tiny_checkpoint

sys.path.append(str(Path(__file__).resolve().parents[1] / "pd"))
sys.path.append(str(Path(__file__).resolve().parents[1] / "reliability"))
from support.pd_stand import Server  # noqa: E402
from support.rel_stand import Router  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# the tiny tokenizer is word level ("t0".."t511"): a template of its own words
TEMPLATE = ("{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
            "{% if add_generation_prompt %}t5{% endif %}")
CONTEXT = 16384  # the tiny checkpoint's positions raised from 512: a stream long enough to leave mid-way
# copy-heavy prompts: motifs repeated, which the random model continues in loops NGRAM finds
COPY_IDS = [[1] + [17, 250, 3, 99] * 5, [4, 8, 15, 16, 23, 42] * 4, [1, 2, 3] * 4, [5, 6, 7, 8] * 5]


def words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture(scope="module")
def stand(tmp_path_factory):
    """(prefill, speculating decode, router, colocated plain reference); all stopped at the end."""
    path = tmp_path_factory.mktemp("tiny_llama_pd_spec")
    make_tiny_checkpoint("llama", str(path))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": CONTEXT}))
    (path / "chat.jinja").write_text(TEMPLATE)
    model = ["--model-path", str(path), "--max-total-tokens", str(CONTEXT), "--chat-template", str(path / "chat.jinja")]
    ngram = ["--speculative-algorithm", "NGRAM"]
    servers = [Server("spec-P", "prefill", *model, *ngram), Server("spec-D", "decode", *model, *ngram),
               Server("spec-C", "null", *model)]
    router = None
    try:
        for s in servers:
            s.wait_ready()
        router = Router("spec-router", servers[:1], servers[1:2]).wait_ready()
        yield servers[0], servers[1], router, servers[2]
    finally:
        for s in [router, *servers]:  # all at once: each drains its own way
            if s is not None:
                s.send(signal.SIGTERM)
        for s in [router, *servers]:
            if s is not None:
                s.stop()


def metric(server, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` on ``server``'s /metrics whose labels include ``labels``."""
    total = 0.0
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def sse(resp: requests.Response) -> list[dict]:
    """The JSON events of a streamed answer, up to ``[DONE]``."""
    assert resp.status_code == 200, resp.text
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def longest_run(ids: list[int]) -> tuple[int, int]:
    """(start, length) of the longest run of one repeated token in ``ids``."""
    best, start = (0, 0), 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            best = max(best, (start, i - start), key=lambda r: r[1])
            start = i
    return best


def post(url: str, path: str, body: dict, stream: bool = False):
    r = requests.post(url + path, json=body, timeout=120, stream=stream)
    if stream:
        return sse(r)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_through_the_router_equals_plain_and_drafts_are_accepted(stand):
    P, D, R, C = stand
    accepted0, verified0 = (metric(D, f"pdserve_spec_{n}_total") for n in ("accepted_tokens", "verify_steps"))
    metas = []
    # SGLang's /generate: copies, with max_tokens cut at lengths that fall inside accepted runs
    for i, ids in enumerate(COPY_IDS):
        for max_new in (40, 13, 7):
            params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
            body = {"input_ids": ids, "sampling_params": params}
            want = post(C.url, "/generate", body)["output_ids"]
            got = post(R.url, "/generate", body)
            assert got["output_ids"] == want, (ids, max_new)
            metas.append(got["meta_info"])
        chunks = post(R.url, "/generate", {**body, "stream": True}, stream=True)
        assert len(chunks) > 1 and chunks[-1]["output_ids"] == want, ids
    assert sum(m["spec_verify_ct"] for m in metas) > 0
    assert sum(m["spec_accept_token_num"] for m in metas) >= len(COPY_IDS) * 10, metas  # copies: most accepted
    assert all(m["spec_accept_length"] >= 1.0 for m in metas if m["spec_verify_ct"])

    # completions and chat, streamed and not, on the copy prompts' words
    for ids in COPY_IDS[:2]:
        comp = {"prompt": words(ids), "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        want = post(C.url, "/v1/completions", comp)["choices"][0]["text"]
        assert post(R.url, "/v1/completions", comp)["choices"][0]["text"] == want
        events = post(R.url, "/v1/completions", {**comp, "stream": True}, stream=True)
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want
        chat = {"messages": [{"role": "user", "content": words(ids)}], "max_tokens": 30,
                "temperature": 0, "ignore_eos": True}
        want = post(C.url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
        assert post(R.url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"] == want
        events = post(R.url, "/v1/chat/completions", {**chat, "stream": True}, stream=True)
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == want

    # stop strings inside a loop the model settled into, where every verify accepts its draft: they
    # end at two consecutive tokens, so one of them on an accepted draft (max_tokens cannot: a draft
    # is cut to the tokens the request may still output, so the last token is never a draft)
    body = {"input_ids": COPY_IDS[2], "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
    full = post(C.url, "/generate", body)["output_ids"]
    start, length = longest_run(full)
    assert length >= 16, f"the premise: the tiny model's output loops on one token ({full})"
    for n in (12, 13):
        stopped = {**body, "sampling_params": {**body["sampling_params"], "stop": [words(full[start:start + n])]}}
        want = post(C.url, "/generate", stopped)
        got = post(R.url, "/generate", stopped)
        assert got["output_ids"] == want["output_ids"] == full[:start + n]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        assert got["meta_info"]["finish_reason"]["type"] == "stop"
        assert got["meta_info"]["spec_accept_token_num"] >= n // 2 - 2, got["meta_info"]

    # /metrics: the decode counted them; the prefill never speculates
    assert metric(D, "pdserve_spec_accepted_tokens_total") - accepted0 >= sum(m["spec_accept_token_num"] for m in metas)
    assert metric(D, "pdserve_spec_verify_steps_total") > verified0
    assert metric(P, "pdserve_spec_verify_steps_total") == 0
    assert "speculative_algorithm NGRAM is ignored here" in P.log(20000)
    P.wait_unleaked()
    D.wait_unleaked()


def test_a_client_leaving_a_speculating_stream_frees_pages_on_both_sides(stand):
    P, D, R, _ = stand
    aborted = metric(D, "pdserve_requests_finished_total", reason="abort")
    body = {"input_ids": COPY_IDS[2], "stream": True,
            "sampling_params": {"max_new_tokens": CONTEXT - 100, "temperature": 0, "ignore_eos": True}}
    events = []
    with requests.post(R.url + "/generate", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 20:  # several verify steps streamed
                break
    # the connection closed mid-stream, long before the last of its tokens (a second or more of them,
    # at the thousands of tokens a second the tiny model and NGRAM decode here): the decode aborts it
    deadline = time.monotonic() + 20
    while metric(D, "pdserve_requests_finished_total", reason="abort") == aborted:
        assert time.monotonic() < deadline, "the decode did not abort the request"
        time.sleep(0.1)
    assert events[-1]["meta_info"]["spec_accept_token_num"] > 0  # it speculated until the client left
    P.wait_unleaked()
    D.wait_unleaked()
