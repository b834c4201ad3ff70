"""Priority scheduling on one real server (``--enable-priority-scheduling``, one running request at
a time): with the server saturated by a long request, low-priority requests queued first and
high-priority ones queued after them are served highest first, arrival order among equals; a
high-priority request's greedy output equals the same request served alone; every page is free
afterwards."""

from __future__ import annotations

import json
import threading

import pytest
import requests
from server_helpers import ServerProcess

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 8


@pytest.fixture(scope="module")
def server():
    # float32: a preempted request's recomputed KV matches its decoded KV closely enough for greedy
    srv = ServerProcess("--enable-priority-scheduling", "--max-running-requests", "1", "--dtype", "float32")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _waiting(server: ServerProcess) -> int:
    return sum(s["num_waiting_reqs"] for s in server.server_info()["internal_states"])


def _wait_for(cond) -> None:
    while not cond():
        threading.Event().wait(0.05)


def body(tag: str, priority: int) -> dict:
    return {"text": f"Story {tag}: once upon a time", "priority": priority,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}


def test_later_high_priorities_are_served_before_earlier_low_ones(server):
    # a long streamed request holds the only running slot until its client goes away
    blocker = requests.post(server.url + "/generate", stream=True, timeout=120, json={
        "text": "Count:", "stream": True, "priority": 100,
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}})
    lines = blocker.iter_lines()
    next(line for line in lines if line)  # the first token: it runs
    done: list[str] = []
    outputs: dict[str, list[int]] = {}
    lock = threading.Lock()

    def send(tag: str, priority: int):
        r = server.post("/generate", body(tag, priority))
        assert r.status_code == 200, r.text
        with lock:
            done.append(tag)
            outputs[tag] = r.json()["output_ids"]

    arrivals = [("low-a", 0), ("low-b", 0), ("high-a", 7), ("mid", 3), ("high-b", 7)]
    threads = []
    for i, (tag, prio) in enumerate(arrivals):
        t = threading.Thread(target=send, args=(tag, prio))
        t.start()
        threads.append(t)
        _wait_for(lambda: _waiting(server) >= i + 1)  # queued in this arrival order
    blocker.close()  # the blocker is aborted: its slot goes to the queue's head
    for t in threads:
        t.join(120)
    assert done == ["high-a", "high-b", "mid", "low-a", "low-b"]
    server.wait_idle_and_unleaked()
    alone = server.post("/generate", body("high-a", 7))
    assert alone.json()["output_ids"] == outputs["high-a"]
    server.wait_idle_and_unleaked()



def _preemptions(server: ServerProcess) -> float:
    text = server.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_preemptions_total{") and 'reason="priority"' in line)


def test_a_high_priority_request_preempts_the_running_low_one(server):
    before = _preemptions(server)
    low_body = {"text": "Count: one, two,", "stream": True, "priority": 0,
                "sampling_params": {"max_new_tokens": 128, "ignore_eos": True, "temperature": 0}}
    low = requests.post(server.url + "/generate", stream=True, timeout=120, json=low_body)
    chunks = (line for line in low.iter_lines() if line and line != b"data: [DONE]")
    next(chunks)  # the first token: it holds the only running slot
    high = server.post("/generate", body("urgent", 9))
    assert high.status_code == 200, high.text
    # the low stream was preempted, not lost: it resumes after the high one and runs to its end
    *_, last = chunks
    low_out = json.loads(last.removeprefix(b"data: "))
    assert low_out["meta_info"]["finish_reason"]["type"] == "length"
    assert _preemptions(server) == before + 1
    server.wait_idle_and_unleaked()
    solo = server.post("/generate", dict(low_body, stream=False)).json()
    assert low_out["output_ids"] == solo["output_ids"]
    assert server.post("/generate", body("urgent", 9)).json()["output_ids"] == high.json()["output_ids"]
    server.wait_idle_and_unleaked()
