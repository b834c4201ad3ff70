"""Faults under load: 2 prefills + 2 decodes behind the router, streamed requests at concurrency 16,
10% of clients disconnecting at random points, while in turn:

1. a prefill is SIGSTOPped past the heartbeat window (1 s x 3), then SIGCONTed;
2. a decode is removed through the router's API, then added back;
3. a prefill is SIGKILLed (the router routes around it);
4. a decode is SIGKILLed (same).

Accounting: every request completes with exactly its tokens, ends with a JSON error, or was
disconnected by its client; none hangs past its deadline; requests keep completing after the kills;
the survivors end with every page free; a request afterwards succeeds.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import requests
from support.pd_stand import greedy_body, prompt_ids
from support import rel_stand

pytestmark = pytest.mark.timeout(500)

soak = rel_stand.load_soak()

# fast dead-peer detection (heartbeat 1 s x 3), generous queueing timeouts
KV = ["--max-total-tokens", "1536", "--disaggregation-bootstrap-timeout", "60",
      "--disaggregation-waiting-timeout", "60"]
LOAD_S = 34.0  # the faults end at ~26 s: the load outlasts them, so completions after the kills count


@pytest.fixture(scope="module")
def pd22():
    with rel_stand.pd22("rel-f", KV, ["--health-check-interval-secs", "1", "--health-failure-threshold", "2"],
                        before_stop=lambda s: s.send(signal.SIGCONT)) as stand:
        yield stand


def test_faults_under_load_every_request_accounted_for(pd22):
    (P1, P2), (D1, D2), R = pd22
    events: list[tuple[float, str]] = []
    t0 = time.monotonic()

    def mark(what: str) -> None:
        events.append((round(time.monotonic() - t0, 1), what))

    async def faults():
        await asyncio.sleep(4)
        mark("SIGSTOP P2")
        P2.send(signal.SIGSTOP)  # (Proc.kill would wait for an exit, then SIGKILL)
        await asyncio.sleep(5)  # past the 3 s heartbeat window
        P2.send(signal.SIGCONT)
        mark("SIGCONT P2")
        assert P2.proc.poll() is None, "P2 died of the SIGSTOP"
        await asyncio.sleep(4)
        url = requests.utils.quote(D2.url, safe="")
        st = await asyncio.to_thread(lambda: requests.delete(f"{R.url}/workers/{url}", timeout=10).status_code)
        mark(f"removed D2 ({st})")
        assert st == 200
        await asyncio.sleep(3)
        st = await asyncio.to_thread(
            lambda: requests.post(R.url + "/workers", json={"url": D2.url, "role": "decode"}, timeout=10).status_code)
        mark(f"added D2 ({st})")
        assert st == 200
        await asyncio.sleep(4)
        mark("SIGKILL P2")
        await asyncio.to_thread(P2.kill)
        await asyncio.sleep(6)
        mark("SIGKILL D2")
        await asyncio.to_thread(D2.kill)

    completed_at: list[float] = []

    def tick(st):
        completed_at.append(time.monotonic() - t0) if st.counts["completed"] > len(completed_at) else None

    async def run():
        load = soak.run_load(R.url, duration=LOAD_S, concurrency=16, deadline=120, seed=21, prompt_lens=(1, 100),
                             max_new=(1, 6), disconnect_frac=0.1, on_tick=tick)
        stats, _ = await asyncio.gather(load, faults())
        return stats

    stats = asyncio.run(run())
    c = stats.counts
    summary = f"counts={c} errors={stats.errors} events={events}"
    assert stats.sent >= 40 and sum(c.values()) == stats.sent, summary
    assert c["hung"] == 0, summary
    assert stats.bad_token_counts == 0, summary
    assert not any("non-JSON" in k for k in stats.errors), summary
    assert c["completed"] >= stats.sent // 2, summary
    last_kill = events[-1][0]
    assert any(t > last_kill for t in completed_at), f"nothing completed after the last kill: {summary}"
    print(summary)
    # the survivors: every page free, healthy
    for s in (P1, D1):
        s.wait_unleaked(timeout=60)
    # the router routes around the dead: a fresh request succeeds
    r = requests.post(R.url + "/generate", json=greedy_body(prompt_ids(9, seed=5), 3), timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text
