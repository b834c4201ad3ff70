"""A prefill stalled past the heartbeat window (SIGSTOP), then woken (SIGCONT).

The decode side fails the stalled prefill's rooms (heartbeat 1 s x 3) and frees their pages. It
must also tell the prefill: otherwise the woken prefill computes those rooms and writes their KV
into decode pages that were freed, and maybe given to other rooms, meanwhile; and it serves
them ahead of new rooms. Proof here: every room's prefill leg ends with the decode's abort, no
prefill leg reports a transfer that succeeded, both sides end unleaked, and new rooms work.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import pytest
from support.pd_stand import greedy_body, pd_post, prompt_ids

pytestmark = pytest.mark.timeout(300)


def test_rooms_failed_by_heartbeat_are_aborted_at_the_woken_prefill(pd11):
    P, D, R = pd11
    prompts = [prompt_ids(500, seed=300 + i) for i in range(4)]
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(pd_post, P, D, "/generate", greedy_body(ids, 4), timeout=120) for ids in prompts]
        time.sleep(0.8)  # rooms bootstrapped; the prefill is computing the first prompt
        P.send(signal.SIGSTOP)
        try:
            time.sleep(5.0)  # > heartbeat window (3 s)
        finally:
            P.send(signal.SIGCONT)
        results = [f.result() for f in futs]
    failed_on_decode = 0
    for p, d in results:
        assert not isinstance(p, Exception) and not isinstance(d, Exception), (p, d)
        if d.status_code != 200:
            failed_on_decode += 1
            assert "unreachable" in d.json()["error"]["message"], d.text
            # the prefill must not have sent KV for a room the decode already gave up
            assert p.status_code != 200, f"prefill sent KV into pages the decode had freed: {p.text}"
            assert "aborted by decode" in p.json()["error"]["message"], p.text
    assert failed_on_decode >= 1, "the stall failed no room: lengthen it"
    P.wait_unleaked(timeout=30)
    D.wait_unleaked(timeout=30)
    p, d = pd_post(P, D, "/generate", greedy_body(prompt_ids(20, seed=399), 3))
    assert d.status_code == 200 and len(d.json()["output_ids"]) == 3, d.text
