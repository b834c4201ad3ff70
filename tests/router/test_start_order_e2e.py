"""Start order, end to end: a real prefill server, a real decode server (the default model) and the
router, started together. The router answers ``/readiness`` "not ready" while the workers load, turns
ready once they serve, and the first request sent after it does succeeds (with no request queue:
a router ready too early would answer 503)."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

import pytest
import requests

from pdserve.entrypoints.procs import free_port, log_tail, spawn, stop_groups

pytestmark = pytest.mark.timeout(400)

SERVER_FLAGS = ["--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "1024",
                "--log-level", "warning"]
POLL_S = 0.05


def first_200(url: str, stop: threading.Event, seen: dict, key: str) -> None:
    """Record in ``seen[key]`` the time ``url`` first answers 200, and in ``seen[key + "_other"]`` the
    time it first answers anything else (the server runs but is not there yet)."""
    while not stop.is_set():
        try:
            status = requests.get(url, timeout=1).status_code
        except requests.RequestException:
            status = None
        if status == 200:
            seen[key] = time.monotonic()
            return
        if status is not None:
            seen.setdefault(key + "_other", time.monotonic())
        time.sleep(POLL_S)


def test_router_and_workers_started_together_serve_once_ready():
    logs = tempfile.mkdtemp(prefix="pdserve-start-order-")
    p_port, p_boot, d_port, r_port = (free_port() for _ in range(4))
    p_url, d_url, r_url = (f"http://127.0.0.1:{p}" for p in (p_port, d_port, r_port))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    serve = [sys.executable, "-m", "pdserve.engine", "--host", "127.0.0.1"]
    argvs = {
        "prefill": serve + ["--port", str(p_port), "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(p_boot), *SERVER_FLAGS],
        "decode": serve + ["--port", str(d_port), "--disaggregation-mode", "decode", *SERVER_FLAGS],
        # the probe gap doubles from 0.5 s up to the interval: 2 s bounds it whatever the model
        # load takes on a loaded machine (with the default 60 s, a worker that answers t seconds
        # after the router started is seen within about min(t, 60) s)
        "router": [sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", str(r_port),
                   "--prefill", p_url, str(p_boot), "--decode", d_url, "--health-check-interval-secs", "2",
                   "--request-queue-timeout-secs", "0", "--log-level", "warning"],
    }
    t0 = time.monotonic()
    procs = {name: spawn(argv, os.path.join(logs, f"{name}.log"), env=env) for name, argv in argvs.items()}
    seen: dict[str, float] = {}
    stop = threading.Event()
    pollers = [threading.Thread(target=first_200, args=(url, stop, seen, key), daemon=True)
               for key, url in (("prefill", p_url + "/health"), ("decode", d_url + "/health"),
                                ("ready", r_url + "/readiness"))]
    try:
        for t in pollers:
            t.start()
        deadline = time.monotonic() + 300
        while "ready" not in seen:
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} exited:\n{log_tail(os.path.join(logs, name + '.log'))}"
            assert time.monotonic() < deadline, f"not ready in 300 s: {seen}"
            time.sleep(POLL_S)
        # the first request after /readiness turned 200 (the router does not wait for a pair: the
        # request queue timeout is 0, so a router that was ready too early would answer 503)
        r = requests.post(r_url + "/generate", json={"text": "The capital of France is",
                                                     "sampling_params": {"max_new_tokens": 4,
                                                                         "temperature": 0}}, timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 4
        for t in pollers:
            t.join(5)
        workers_up = max(seen["prefill"], seen["decode"])
        lag = seen["ready"] - workers_up
        print(f"workers healthy {workers_up - t0:.1f} s after start; /readiness 200 {lag:.2f} s later")
        # the order that makes this a start-order test: the router answered "not ready" while its
        # workers were still loading (that it turned ready only once they served is the 200 above)
        assert seen["ready_other"] < workers_up, seen
    finally:
        stop.set()
        stop_groups(procs.values())
