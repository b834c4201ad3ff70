"""Reasoning through the router and a 1P1D pair (``--reasoning-parser qwen3``): outputs forced by a regex
into ``<think>...</think>answer`` come back split, whole and streamed, and the request fields that turn
the split off are obeyed."""

from __future__ import annotations

import re
import sys

import openai
import pytest
from support.pd_stand import Proc, Server

from pdserve.entrypoints.procs import free_port, wait_healthy

pytestmark = pytest.mark.timeout(600)

FLAGS = ("--max-total-tokens", "2048", "--reasoning-parser", "qwen3")
SHAPE = r"<think>[a-z]{2,8}( [a-z]{2,8}){1,3}</think>\n(Yes|No)\."
MESSAGES = [{"role": "user", "content": "Is the sky blue? Think first."}]


@pytest.fixture(scope="module")
def client():
    P = Server("rP", "prefill", *FLAGS)
    D = Server("rD", "decode", *FLAGS)
    router = None
    try:
        P.wait_ready()
        D.wait_ready()
        port = free_port()
        router = Proc("rrouter", [sys.executable, "-m", "pdserve.router", "--prefill", P.url, str(P.bootstrap_port),
                                  "--decode", D.url, "--host", "127.0.0.1", "--port", str(port)])
        wait_healthy(f"http://127.0.0.1:{port}", router.proc, 30, name="router", log=router.log)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    finally:
        for p in (router, P, D):
            if p is not None:
                p.stop()


def _ask(client, stream=False, **extra):
    return client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=48, temperature=0,
                                          stream=stream, extra_body={"regex": SHAPE, **extra})


def test_split_whole_and_streamed(client):
    msg = _ask(client).choices[0].message
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,3}", msg.reasoning_content)
    assert msg.content in ("Yes.", "No.")
    kinds, reasoning, content = [], "", ""
    for chunk in _ask(client, stream=True):
        for choice in chunk.choices:
            d = choice.delta
            r, c = getattr(d, "reasoning_content", None) or "", d.content or ""
            reasoning += r
            content += c
            kinds += ["r"] * bool(r) + ["c"] * bool(c)
    assert (reasoning, content) == (msg.reasoning_content, msg.content)
    assert kinds.index("c") > kinds.count("r") - 1 and kinds.count("r") > 1  # thinking streams first, in pieces
    assert "<" not in reasoning + content


def test_reasoning_not_streamed_comes_in_one_delta(client):
    deltas = [getattr(ch.delta, "reasoning_content", None) for chunk in _ask(client, True, stream_reasoning=False)
              for ch in chunk.choices]
    assert len([d for d in deltas if d]) == 1


def test_split_turned_off(client):
    whole = _ask(client, separate_reasoning=False).choices[0].message
    assert whole.content.startswith("<think>") and whole.reasoning_content is None
    off = _ask(client, chat_template_kwargs={"enable_thinking": False}).choices[0].message
    assert "</think>" in off.content and off.reasoning_content is None


def test_budget_ends_the_thinking(client):
    # this prompt makes the greedy default model think until max_tokens, never reaching an answer
    story = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    shape = r"<think>[a-z]+( [a-z]+)*</think>\n(Yes|No)\."
    free, capped = (client.chat.completions.create(model="default", messages=story, max_tokens=48, temperature=0,
                                                   extra_body={"regex": shape, **budget})
                    for budget in ({}, {"thinking_budget": 8}))
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.content
    choice = capped.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content in ("Yes.", "No.")
    thought, free_thought = choice.message.reasoning_content, free.choices[0].message.reasoning_content
    # greedy: the capped thinking is the free one cut where the budget forced the closing marker
    assert thought and free_thought.startswith(thought) and len(thought) < len(free_thought)
    assert capped.usage.completion_tokens < free.usage.completion_tokens


def test_budget_needs_thinking(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4,
                                       extra_body={"thinking_budget": 4,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    assert "thinking_budget" in str(e.value)
