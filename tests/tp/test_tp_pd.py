"""Disaggregated serving with tensor parallelism on both sides, including different TP sizes.

Stand, one per transfer backend, on the tiny Llama (4 query heads, 2 KV heads, fp32): prefill servers
P1 (TP 1) and P2 (TP 2), decode servers D1 (TP 1) and D2 (TP 2), and the colocated TP 1 server as the
reference. P2 -> D1 cuts each prefill rank's page runs into half of D1's heads; P1 -> D2 cuts P1's
page runs in two, one half per decode rank; P2 -> D2 moves whole page runs rank to rank. Every check
ends with every server's pool proven unleaked (every page free after a cache flush; each TP rank runs
the idle integrity check of its own pool shard, and a failed one takes the server down, which the
health check sees). The faults run last and end the stand.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import requests
from support.pd_stand import Server, greedy_body, pd_post, sglang_router

from pdserve.kvtransfer.bootstrap_server import BootstrapServer

pytestmark = [
    pytest.mark.timeout(900),
]

# prompts within the tiny vocabulary: one token, one page, across two 64-token chunks
PROMPTS = [[1], [1, 5, 9, 33, 100, 7, 8], list(range(3, 70)), [4, 8, 15, 16, 23, 42] * 25]
MAX_NEW = 8
BOOTSTRAP_TIMEOUT = 20.0
PAIRS = [("P2", "D1"), ("P1", "D2"), ("P2", "D2")]


def rank_pids(server: Server) -> dict[str, int]:
    """The server's scheduler processes by name (pdserve-dp0-tp1, ...)."""
    out = {}
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                name = Path(f"/proc/{child}/comm").read_text().strip()
            except OSError:
                continue
            if name.startswith("pdserve-dp"):
                out[name] = int(child)
    return out


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def stand(request, tiny_checkpoints):
    backend = request.param
    if backend == "nixl":
        pytest.importorskip("nixl")
    model = ["--model-path", tiny_checkpoints["llama"], "--max-total-tokens", "2048"]
    # seven scheduler processes share 2 cores here, and over NIXL each idle rank's UCX progress thread
    # spins (nixl's Python agent runs it with no delay: 45-50% of a core per idle rank, measured): a
    # heartbeat reply can wait more than pd_stand's 3 s window and a room's destination more than its
    # 4 s bootstrap timeout (6 s and 10 s were seen, on a loaded machine), so this stand allows 15 s
    # for both and 60 s of waiting; the faults' rooms still end by heartbeat or abort in seconds
    kv = ["--disaggregation-heartbeat-max-failures", "15", "--disaggregation-bootstrap-timeout", str(BOOTSTRAP_TIMEOUT),
          "--disaggregation-waiting-timeout", "60"]
    servers = {
        "colocated": Server(f"tp-colocated-{backend}", "null", *model),
        "P1": Server(f"tp-P1-{backend}", "prefill", *model, *kv, backend=backend),
        "P2": Server(f"tp-P2-{backend}", "prefill", *model, *kv, "--tp-size", "2", backend=backend),
        "D1": Server(f"tp-D1-{backend}", "decode", *model, *kv, backend=backend),
        "D2": Server(f"tp-D2-{backend}", "decode", *model, *kv, "--tp-size", "2", backend=backend),
    }
    try:
        for s in servers.values():
            s.wait_ready()
        servers["backend"] = backend
        yield servers
    finally:
        for name, s in servers.items():
            if name != "backend":
                s.stop()


def _reference(stand, ids):
    r = stand["colocated"].post("/generate", greedy_body(ids, MAX_NEW))
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _topology(prefill: Server, timeout: float = 60.0) -> dict:
    """The prefill server's bootstrap topology, once every TP rank registered (503 until then)."""
    deadline = time.monotonic() + timeout
    while True:
        r = requests.get(f"http://{prefill.host}:{prefill.bootstrap_port}/route", timeout=5)
        if r.status_code == 200 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return r.json()
        time.sleep(0.2)


def _unleaked(stand, names=("P1", "P2", "D1", "D2")):
    for name in names:
        stand[name].wait_unleaked()


def test_mismatched_and_matched_tp_pairs_equal_colocated(stand):
    assert sorted(rank_pids(stand["P2"])) == ["pdserve-dp0-tp0", "pdserve-dp0-tp1"]
    assert sorted(rank_pids(stand["D2"])) == ["pdserve-dp0-tp0", "pdserve-dp0-tp1"]
    refs = {tuple(ids): _reference(stand, ids) for ids in PROMPTS}
    with cf.ThreadPoolExecutor(6) as ex:
        jobs = [(ids, p, d, ex.submit(pd_post, stand[p], stand[d], "/generate", greedy_body(ids, MAX_NEW)))
                for p, d in PAIRS for ids in PROMPTS]
        for ids, p, d, fut in jobs:
            pr, dr = fut.result()
            assert not isinstance(pr, Exception) and not isinstance(dr, Exception), (p, d, pr, dr)
            # a str message is printed whole (a tuple's repr is cut): both answers and both servers' log tails
            assert pr.status_code == 200 and dr.status_code == 200, (
                f"{p} -> {d}: prefill {pr.text}\ndecode {dr.text}\n{p} log:\n{stand[p].log(1500)}\n"
                f"{d} log:\n{stand[d].log(1500)}")
            assert dr.json()["output_ids"] == refs[tuple(ids)], (p, d, len(ids))
    _unleaked(stand)
    # each TP rank counts the rooms and KV bytes of its own heads (/metrics, tp_rank label)
    for name, bytes_name in (("P2", "pdserve_kv_transfer_sent_bytes_total"),
                             ("D2", "pdserve_kv_transfer_received_bytes_total")):
        text = requests.get(stand[name].url + "/metrics", timeout=10).text
        per_rank = {}
        for tp in (0, 1):
            rank = f'dp_rank="0",tp_rank="{tp}"'
            rooms = [line for line in text.splitlines()
                     if line.startswith("pdserve_kv_rooms_total{") and rank in line and 'state="success"' in line]
            sent = [line for line in text.splitlines() if line.startswith(bytes_name + "{") and rank in line]
            assert rooms and float(rooms[0].rsplit(" ", 1)[1]) == 2 * len(PROMPTS), (name, tp, text)
            per_rank[tp] = float(sent[0].rsplit(" ", 1)[1])
        assert per_rank[0] == per_rank[1] > 0, (name, per_rank)  # one KV head each


def test_decode_tp2_finds_both_prefill_tp_ranks(stand):
    P2 = stand["P2"]
    topo = _topology(P2)
    assert topo["tp_size"] == 2 and [r["tp_rank"] for r in topo["ranks"]] == [0, 1]
    assert topo["ranks"][0]["kv_heads"] == 2 and topo["ranks"][0]["num_kv_heads"] == 1
    assert len({r["endpoint"] for r in topo["ranks"]}) == 2


def test_prefill_with_a_missing_tp_rank_fails_rooms_naming_it(stand):
    """A prefill server whose TP rank 1 never registered: the decode's rooms wait, then fail after
    bootstrap_timeout (BOOTSTRAP_TIMEOUT on this stand) with a message naming the missing rank.

    The decode is TP 2: both ranks time out within a step of each other, and when rank 1's fires
    first the client (answered by rank 0) reads rank 1's reason, carried by the TP agreement."""
    real = _topology(stand["P2"])["ranks"][0]
    fake = BootstrapServer("127.0.0.1", 0, dp_size=1, tp_size=2).start_in_thread()
    try:
        body = dict(real, endpoint="127.0.0.1:9")  # rank 0 only, at an endpoint nobody answers
        req = urllib.request.Request(f"http://127.0.0.1:{fake.port}/route", data=json.dumps(body).encode(),
                                     method="PUT", headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).close()
        t0 = time.monotonic()
        r = stand["D2"].post("/generate", dict(greedy_body(PROMPTS[1], 2), bootstrap_host="127.0.0.1",
                                               bootstrap_port=fake.port, bootstrap_room=12345,
                                               disagg_prefill_dp_rank=0))
        assert time.monotonic() - t0 >= BOOTSTRAP_TIMEOUT - 0.5, "the room waited for the missing rank"
        assert r.status_code == 500, r.text
        msg = r.json()["error"]["message"]
        assert "bootstrap_timeout" in msg and "missing: dp 0 tp 1" in msg, msg
    finally:
        fake.stop_thread()
    _unleaked(stand, ("D2",))


def test_sglang_router_in_front_of_p2_d2(stand):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    if stand["backend"] != "mooncake":
        pytest.skip("one backend behind sglang-router is enough")
    P, D = stand["P2"], stand["D2"]
    with sglang_router("tp-sglang-router", P, D) as url:
        for ids in PROMPTS[1:3]:
            r = requests.post(f"{url}/generate", json=greedy_body(ids, MAX_NEW), timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == _reference(stand, ids)
    _unleaked(stand, ("P2", "D2"))


def _flood(prefill: Server, decode: Server, n: int = 6):
    """Long prompts in flight from ``prefill`` to ``decode`` (their answers are collected later)."""
    ex = cf.ThreadPoolExecutor(n)
    futs = [ex.submit(pd_post, prefill, decode, "/generate", greedy_body([7 + i] + list(range(10, 400)), 30),
                      timeout=60) for i in range(n)]
    return ex, futs


def _wait_inflight(server: Server, timeout: float = 30.0) -> None:
    """Until the server's front end holds a request (the flood reached it)."""
    deadline = time.monotonic() + timeout
    while not any(st["inflight"] for st in server.states()):
        assert time.monotonic() < deadline, f"no request reached {server.name}"
        time.sleep(0.01)


def test_sigkill_of_a_tp_process_mid_transfer_frees_every_surviving_pool(stand):
    """Decode side first: D2's TP rank 1 dies while P1 sends to D2; P1's rooms fail and free, D2 goes down.
    Then the prefill side: P2's TP rank 1 dies while P2 sends to D1; D1's rooms fail and free."""
    if stand["backend"] != "mooncake":
        pytest.skip("the faults run on one backend")
    for victim_name, prefill, decode, survivor in (("D2", "P1", "D2", "P1"), ("P2", "P2", "D1", "D1")):
        victim = stand[victim_name]
        pid = rank_pids(victim)["pdserve-dp0-tp1"]
        ex, futs = _flood(stand[prefill], stand[decode])
        _wait_inflight(victim)  # a transfer takes milliseconds here: strike as soon as requests arrived
        os.kill(pid, signal.SIGKILL)
        results = [f.result() for f in futs]
        ex.shutdown()
        assert any(isinstance(r, Exception) or r.status_code != 200 for pair in results for r in pair), results
        # the dead side's server goes down (its TP group broke)
        deadline = time.monotonic() + 60
        while victim.proc.poll() is None and time.monotonic() < deadline:
            try:
                if requests.get(victim.url + "/health", timeout=2).status_code != 200:
                    break
            except requests.RequestException:
                break
            time.sleep(0.5)
        else:
            assert victim.proc.poll() is not None, f"{victim_name} still healthy\n{victim.log()}"
        stand[survivor].wait_unleaked(timeout=60)
