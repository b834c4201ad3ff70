"""pdserve.entrypoints.procs on real processes: a stop reaches the whole process group (a child's own
children too), SIGKILL follows a SIGTERM that is ignored, waiting for /health sees an early exit,
and free_port never hands out a port twice."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from pdserve.entrypoints.procs import free_port, group_pids, spawn, stop_group, wait_healthy

pytestmark = pytest.mark.timeout(60)

# a parent that starts a grandchild in its own group, then sleeps; with IGNORE both ignore SIGTERM
FAMILY = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal, sys, time\\n"
                  "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                  "print('child up', flush=True); time.sleep(60)", sys.argv[1]])
time.sleep(60)
"""


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.parametrize("mode, stops_on_sigterm", [("obey", True), ("ignore", False)])
def test_stop_group_leaves_no_process_of_the_group(tmp_path, mode, stops_on_sigterm):
    log = tmp_path / "family.log"
    proc = spawn([sys.executable, "-c", FAMILY, mode], log)
    try:
        wait_for(lambda: "child up" in log.read_text().splitlines())  # a line of its own, not the "$ argv" line
        assert len(group_pids(proc.pid)) == 2  # the child and its own child, one group
        # True: SIGTERM was enough; False: the group outlived the grace and took a SIGKILL
        assert stop_group(proc, grace=1.0) is stops_on_sigterm
        assert group_pids(proc.pid) == []
    finally:
        for pid in group_pids(proc.pid):  # whatever a failed stop left
            os.kill(pid, signal.SIGKILL)
    assert proc.poll() is not None  # reaped, not a zombie
    assert log.read_text().startswith(f"$ {sys.executable} -c")


def test_wait_healthy_returns_once_health_answers_and_raises_when_the_process_exits(tmp_path):
    (tmp_path / "health").write_text("ok")  # http.server answers GET /health with this file
    port = free_port()
    server = spawn([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                    "--directory", str(tmp_path)], tmp_path / "server.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, 30)
    finally:
        stop_group(server)
    dead = spawn([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "dead.log")
    with pytest.raises(RuntimeError, match="exited with 3"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", dead, 30, name="dead", log=lambda: "its log")
    with pytest.raises(TimeoutError, match="not healthy within"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", None, 0.3)


def test_free_port_never_repeats():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_free_port_is_below_the_ephemeral_range_so_no_outbound_connection_takes_it():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    if low < 21000:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it")
    ports = [free_port() for _ in range(50)]
    assert all(20000 <= p < low for p in ports), ports


def test_stop_group_continues_a_stopped_group(tmp_path):
    proc = spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], tmp_path / "s.log")
    wait_for(lambda: "up" in (tmp_path / "s.log").read_text().splitlines())
    proc.send_signal(signal.SIGSTOP)
    assert stop_group(proc, grace=3.0)  # SIGTERM is handled once the group is continued: no SIGKILL
    assert group_pids(proc.pid) == []
