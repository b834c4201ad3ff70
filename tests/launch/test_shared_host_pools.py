"""Servers started together on one host with default flags: a TP 3 prefill server, a TP
1 decode server and a colocated TP 3 server start in the same second while another process
allocates 6 GB; all start, each takes the stated CPU default pool (``pool_sizing``: the same as
when it loads alone, whatever the others do), and their pools together fit the host. The same
freshly started servers, with a router in front of the prefill and decode, export every metric the
Grafana dashboard plots before any request. One stand for both: seven ranks load on two cores."""

from __future__ import annotations

import os
import sys
import time
import urllib.request

import pytest
from support.promql_util import dashboard_exprs, exported_names, metric_names

from pdserve.engine.mem_cache.host_memory import host_memory_bytes
from pdserve.engine.model_executor.pool_sizing import DEFAULT_POOL_CONTEXTS
from pdserve.entrypoints.procs import free_port, get_json, log_tail, spawn, stop_groups, wait_healthy

pytestmark = pytest.mark.timeout(900)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PDSERVE_NUM_THREADS": "1"}
HOG_BYTES = 6 * 2**30
# touches HOG_BYTES while the servers load, then holds them until killed
HOG = f"import time, torch; t = torch.ones({HOG_BYTES}, dtype=torch.uint8); print('held', flush=True); time.sleep(3600)"


def test_servers_started_together_take_the_default_pool_and_export_the_dashboards_metrics(tmp_path):
    boot = free_port()
    servers = {  # name -> (flags, port)
        "prefill_tp3": (["--tp-size", "3", "--disaggregation-mode", "prefill",
                         "--disaggregation-bootstrap-port", str(boot)], free_port()),
        "decode_tp1": (["--disaggregation-mode", "decode"], free_port()),
        "colocated_tp3": (["--tp-size", "3"], free_port()),
    }
    procs = {}
    try:
        procs["hog"] = spawn([sys.executable, "-c", HOG], tmp_path / "hog.log", env=ENV)
        for name, (flags, port) in servers.items():  # the same second, no sizing flags
            procs[name] = spawn([sys.executable, "-m", "pdserve.engine", "--port", str(port), *flags],
                                tmp_path / f"{name}.log", env=ENV)
        for name, (_, port) in servers.items():
            wait_healthy(f"http://127.0.0.1:{port}", procs[name], 600, name=name,
                         log=lambda n=name: log_tail(tmp_path / f"{n}.log"))
        assert procs["hog"].poll() is None and "held" in (tmp_path / "hog.log").read_text()
        infos = {name: get_json(f"http://127.0.0.1:{port}/server_info", 10) for name, (_, port) in servers.items()}
        for name, info in infos.items():
            assert info["max_total_num_tokens"] == DEFAULT_POOL_CONTEXTS * info["max_context_len"], name
            assert info["kv_pool_bytes"] > 0, name
            assert "KV pool: " in (tmp_path / f"{name}.log").read_text()  # logged, with how to change it
        assert sum(i["kv_pool_bytes"] for i in infos.values()) < host_memory_bytes() // 4
        stop_groups([procs.pop("hog")])

        router_port = free_port()
        procs["router"] = spawn([sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port",
                                 str(router_port), "--prefill", f"http://127.0.0.1:{servers['prefill_tp3'][1]}",
                                 str(boot), "--decode", f"http://127.0.0.1:{servers['decode_tp1'][1]}"],
                                tmp_path / "router.log", env=ENV)
        deadline = time.monotonic() + 60
        while get_json(f"http://127.0.0.1:{router_port}/readiness") is None:
            assert time.monotonic() < deadline and procs["router"].poll() is None, log_tail(tmp_path / "router.log")
            time.sleep(0.1)
        exported = set()
        for port in (servers["prefill_tp3"][1], servers["decode_tp1"][1], router_port):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                exported |= exported_names(r.read().decode())
        wanted = set().union(*map(metric_names, dashboard_exprs()))
        assert wanted and not wanted - exported, sorted(wanted - exported)
    finally:
        stop_groups(list(procs.values()))
