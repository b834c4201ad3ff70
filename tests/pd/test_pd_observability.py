"""Observability of a real 1P1D stand: /metrics of the prefill, decode and router, and
the ``--log-requests`` lines.

Stand: a prefill server whose Mooncake writes fail at random (``faulty_mooncake``: 40%, seeded;
``tests/reliability/fault_injection_engine.py``), a decode server on plain Mooncake, both with
``--log-requests``, and the router in this process. Prompts fit one 64-token chunk, so a room is
one write: it succeeds whole or fails whole, and the KV bytes are exact.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests
from support.pd_stand import InProcessRouter, Server, greedy_body, pd_post, prompt_ids, wait_for
from support.promql_util import dashboard_exprs, exported_names, metric_names
from support.request_log_util import check_decode_stages, check_joined, check_prefill_stages, join, parse_log

from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(600)

RELIABILITY = str(Path(__file__).resolve().parents[1] / "reliability")
INJECTED = "injected transfer fault"  # fault_injection_engine.INJECTED
# the default model (docs/DESIGN.md): 30 layers, 3 KV heads of 64; fp32; 16-token pages; K and V
PAGE_SIZE = 16
PAGE_BYTES = 30 * 2 * 3 * 64 * 4 * PAGE_SIZE
QUEUES = ("pdserve_num_prefill_prealloc_queue_reqs", "pdserve_num_prefill_inflight_queue_reqs",
          "pdserve_num_decode_prealloc_queue_reqs", "pdserve_num_decode_transfer_queue_reqs")


@pytest.fixture(scope="module")
def stand():
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [RELIABILITY, os.environ.get("PYTHONPATH")]))}
    p = Server("obs-P", "prefill", "--log-requests", "--max-total-tokens", "2048",
               backend="fault_injection_engine:faulty_mooncake", env=env)
    d = Server("obs-D", "decode", "--log-requests", "--max-total-tokens", "2048")
    r = None
    try:
        p.wait_ready()
        d.wait_ready()
        r = InProcessRouter(RouterConfig(prefill=(WorkerSpec(p.url, "prefill", p.bootstrap_port),),
                                         decode=(WorkerSpec(d.url, "decode"),), health_check_interval_secs=3600))
        yield p, d, r
    finally:
        if r is not None:
            r.close()
        for s in (p, d):
            s.stop()


def scrape(url: str) -> dict[str, float]:
    """A server's /metrics samples: ``name{labels}`` -> value."""
    out = {}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (over every DP and TP rank)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for key, v in samples.items()
               if key.split("{")[0] == name and all(w in key for w in want))


def test_metrics_move_with_the_rooms(stand):
    P, D, _ = stand
    p0, d0 = scrape(P.url), scrape(D.url)
    ok_pages, failed = 0, 0
    for i in range(8):
        ids = prompt_ids(10 + 7 * i, seed=400 + i)  # 10..59 tokens: one chunk, 1 to 4 pages
        p, d = pd_post(P, D, "/generate", greedy_body(ids, 2))
        if d.status_code == 200:
            assert p.status_code == 200, p.text
            ok_pages += -(-len(ids) // PAGE_SIZE)
        else:  # both legs name the injected fault's room failure
            assert INJECTED in p.text and "KV transfer failed" in d.text, (p.text, d.text)
            failed += 1
    assert failed and ok_pages, "the seeded faults should fail some rooms and not all"
    ok = 8 - failed

    def settled() -> bool:
        p1, d1 = scrape(P.url), scrape(D.url)
        return (total(p1, "pdserve_kv_rooms_total") - total(p0, "pdserve_kv_rooms_total") == 8
                and total(d1, "pdserve_kv_rooms_total") - total(d0, "pdserve_kv_rooms_total") == 8
                and not any(total(s, q) for s in (p1, d1) for q in QUEUES)
                and total(d1, "pdserve_kv_quarantine_pages") == 0)

    wait_for(settled, 30, "every room counted, the queues and the quarantine empty")
    p1, d1 = scrape(P.url), scrape(D.url)

    def delta(new, old, name, **labels):
        return total(new, name, **labels) - total(old, name, **labels)

    kv_bytes = ok_pages * PAGE_BYTES
    assert delta(p1, p0, "pdserve_kv_transfer_sent_bytes_total") == kv_bytes
    assert delta(d1, d0, "pdserve_kv_transfer_received_bytes_total") == kv_bytes
    for new, old in ((p1, p0), (d1, d0)):
        assert delta(new, old, "pdserve_kv_rooms_total", state="success") == ok
        assert delta(new, old, "pdserve_kv_rooms_total", state="failed", cause="transfer") == failed
        assert delta(new, old, "pdserve_kv_transfer_latency_seconds_count") == ok
        assert delta(new, old, "pdserve_kv_transfer_exposed_seconds_count") == ok
    # labelled with the ranks they come from
    assert any('dp_rank="0",tp_rank="0"' in key for key in p1 if key.startswith("pdserve_kv_rooms_total"))


def test_request_log_lines_join_on_the_room(stand):
    P, D, _ = stand
    rooms = []
    for i in range(6):  # until a room succeeds (40% of writes fail)
        room = 10_000 + i
        _, d = pd_post(P, D, "/generate", greedy_body(prompt_ids(40, seed=500 + i), 3), room=room)
        rooms.append((room, d.status_code == 200))
        if rooms[-1][1]:
            break
    room = next(r for r, ok in rooms if ok)

    def lines() -> dict:
        return join(parse_log(P.log(10**7)) + parse_log(D.log(10**7)))

    wait_for(lambda: set(lines().get(room, {})) == {"prefill", "decode"}, 10, "both sides' lines")
    sides = lines()[room]
    p, d = sides["prefill"], sides["decode"]
    assert p["rid"] and d["rid"] and p["prompt_tokens"] == d["prompt_tokens"] == 40
    check_prefill_stages(p["stages"], 1)
    check_decode_stages(d["stages"])
    check_joined(p, d)
    # a room that failed has its lines too, ending without success
    for failed_room, ok in rooms:
        if not ok:
            wait_for(lambda: "prefill" in lines().get(failed_room, {}), 10, "the failed room's line")
            stages = [s["stage"] for s in lines()[failed_room]["prefill"]["stages"]]
            assert "success" not in stages and stages[-1] == "finished"


def test_every_dashboard_metric_is_exported(stand):
    P, D, R = stand
    for i in range(2):  # through the router, so its histograms have samples too
        r = requests.post(f"http://127.0.0.1:{R.port}/generate", json=greedy_body(prompt_ids(20, 600 + i), 2),
                          timeout=120)
        assert r.status_code in (200, 502), r.text
    exported = set()
    for url in (P.url, D.url, f"http://127.0.0.1:{R.port}"):
        exported |= exported_names(requests.get(url + "/metrics", timeout=10).text)
    wanted = set().union(*map(metric_names, dashboard_exprs()))
    assert wanted and not wanted - exported, sorted(wanted - exported)
