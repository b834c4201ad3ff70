"""``pdserve serve --tp-size 2`` on a tiny checkpoint: the same outputs as TP 1 (greedy and seeded
sampling, requests batched together), and a TP process's death takes the DP rank down cleanly.

One server for the module; the fault test runs last and ends it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from server_helpers import ServerProcess, is_running, rank_pids

from pdserve.entrypoints.engine import Engine

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 5, 9, 33, 100, 7], list(range(3, 40)), [1] + [17, 250, 3] * 9, [4, 4, 8, 15, 16, 23, 42]]
PARAMS = [
    {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
    {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": True},
]


@pytest.fixture(scope="module")
def tp2_server(tiny_checkpoints):
    server = ServerProcess("--model-path", tiny_checkpoints["llama"], "--dtype", "float32", "--tp-size", "2")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tp1_outputs(tiny_checkpoints):
    with Engine(model_path=tiny_checkpoints["llama"], dtype="float32", max_total_tokens=4096) as engine:
        return [[engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in PROMPTS] for sp in PARAMS]


def test_tp2_server_equals_tp1(tp2_server, tp1_outputs):
    assert sorted(rank_pids(tp2_server.proc.pid)) == ["pdserve-dp0-tp0", "pdserve-dp0-tp1"]
    for sp, want in zip(PARAMS, tp1_outputs):
        results: list = [None] * len(PROMPTS)

        def ask(i: int) -> None:
            results[i] = tp2_server.post("/generate", {"input_ids": PROMPTS[i], "sampling_params": sp})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]  # batched together
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.json()["output_ids"] for r in results] == want, sp
    tp2_server.wait_idle_and_unleaked()


def test_killed_tp_process_takes_the_dp_rank_down(tp2_server):
    pids = rank_pids(tp2_server.proc.pid)
    result = {}

    def long_request() -> None:
        result["r"] = tp2_server.post("/generate", {
            "input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while tp2_server.server_info()["internal_states"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    os.kill(pids["pdserve-dp0-tp1"], signal.SIGKILL)
    t.join(30)
    r = result["r"]
    assert r.status_code == 503
    assert "DP rank 0 TP rank 1 exited with code -9" in r.json()["error"]["message"], r.text
    # the server drains for a second before it exits: unhealthy meanwhile
    assert tp2_server.get("/health").status_code == 503
    assert tp2_server.proc.wait(30) == 1  # the server exits, stopping the surviving TP rank
    for pid in pids.values():
        deadline = time.monotonic() + 10
        while is_running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_running(pid), f"rank process {pid} left behind"


def test_hung_tp_process_fails_the_collective_within_the_timeout(tiny_checkpoints):
    """A TP process that stops answering (SIGSTOP) is not dead: its peer's collective times out
    after --dist-timeout and the DP rank goes down as for a death; nothing waits forever."""
    server = ServerProcess("--model-path", tiny_checkpoints["llama"], "--dtype", "float32", "--tp-size", "2",
                           "--dist-timeout", "2").wait_ready()
    pids = rank_pids(server.proc.pid)
    try:
        result = {}

        def long_request() -> None:
            result["r"] = server.post("/generate", {
                "input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 400, "temperature": 0,
                                                             "ignore_eos": True}})

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        os.kill(pids["pdserve-dp0-tp1"], signal.SIGSTOP)
        t.join(120)
        assert not t.is_alive(), "the request still waits on the stopped rank"
        r = result["r"]
        assert r.status_code == 503, r.text
        assert "DP rank 0" in r.json()["error"]["message"], r.text
        assert server.proc.wait(30) == 1
        for pid in pids.values():  # the stopped one too (SIGKILL reaches a stopped process)
            deadline = time.monotonic() + 10
            while is_running(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not is_running(pid), f"rank process {pid} left behind"
    finally:
        server.stop()
        for pid in pids.values():
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
