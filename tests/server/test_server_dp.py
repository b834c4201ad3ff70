"""DP=2: both ranks serve (visible in /metrics) with the offline engine's greedy outputs; SIGTERM cleans up."""

from __future__ import annotations

import re
import signal
import time

import pytest
from server_helpers import ServerProcess, children_of, greedy_ref, is_running

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn is"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def started_server():
    srv = ServerProcess("--dp-size", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(started_server, engine):
    return started_server.wait_ready()


def _requests_by_rank(server: ServerProcess) -> dict[int, float]:
    text = server.get("/metrics").text
    return {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r'^pdserve_requests_total\{[^}]*dp_rank="(\d)"\} (\S+)$', text, re.M)
    }


def test_both_ranks_serve_the_same_greedy_outputs(server, engine):
    before = _requests_by_rank(server)
    ranks_seen = set()
    for p in PROMPTS:
        ref = greedy_ref(engine, engine.tokenizer.encode(p), MAX_NEW)
        r = server.post("/generate", {"text": p, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == ref["output_ids"], p
        assert out["text"] == ref["text"]
        ranks_seen.add(out["meta_info"]["dp_rank"])
    assert ranks_seen == {0, 1}
    after = _requests_by_rank(server)
    assert after[0] > before.get(0, 0) and after[1] > before.get(1, 0)


def test_routed_dp_rank(server, engine):
    p = PROMPTS[0]
    ref = greedy_ref(engine, engine.tokenizer.encode(p), MAX_NEW)
    for rank in (1, 0, 1):
        r = server.post(
            "/v1/completions",
            {"prompt": p, "max_tokens": MAX_NEW, "temperature": 0, "routed_dp_rank": rank},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref["text"]
    r = server.post("/generate", {"text": p, "routed_dp_rank": 1, "sampling_params": {"max_new_tokens": 1}})
    assert r.json()["meta_info"]["dp_rank"] == 1
    r = server.post("/generate", {"text": p, "routed_dp_rank": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_dp_rank"
    info = server.server_info()
    assert info["dp_size"] == 2 and len(info["internal_states"]) == 2
    server.wait_idle_and_unleaked()


def test_sigterm_leaves_no_process_behind(server):
    pid = server.proc.pid
    children = children_of(pid)
    assert len([c for c in children if "spawn_main" in open(f"/proc/{c}/cmdline").read()]) == 2
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0  # a clean exit, then: no rank process left behind
    deadline = time.monotonic() + 2
    while any(is_running(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_running(c) for c in children), [c for c in children if is_running(c)]
