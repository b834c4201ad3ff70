"""Rolling restarts under load: 2 prefill + 2 decode servers behind the router, 16 concurrent streams.

Each server of a pool is restarted in turn while the streams run, the way an operator does it:
the first the Kubernetes way (``POST /workers/drain`` on the router, SIGTERM to the server's main
process), the second the systemd way (SIGTERM to its whole process group, scheduler ranks included,
and no word to the router). Each is SIGTERMed with requests in flight, drains, exits 0, starts
again on the same ports and is taken back by the router. Every request completes, with the same
greedy tokens as the run without a restart; afterwards no page is left in use on any server.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from support import rel_stand
from conftest import LOAD_KV

pytestmark = pytest.mark.timeout(900)

soak = rel_stand.load_soak()

POOL = 32  # distinct prompts; the restart run cycles through them
LOAD = dict(concurrency=16, deadline=240, seed=16, prompt_lens=(1, 100), max_new=(4, 12), pool=POOL)
DRAIN = ["--graceful-shutdown-timeout", "120"]


@pytest.fixture(scope="module")
def pd22():
    server_args = ["--max-total-tokens", "2048", *LOAD_KV, *DRAIN]
    with rel_stand.pd22("rr", server_args, ["--health-check-interval-secs", "1", "--request-queue-timeout-secs", "120"]) as stand:
        yield stand


@pytest.fixture(scope="module")
def reference(pd22):
    """The outputs of the run without a restart: every prompt of the pool once."""
    _, _, r = pd22
    stats = asyncio.run(soak.run_load(r.url, n=POOL, **LOAD))
    assert stats.counts["completed"] == POOL, (stats.counts, stats.errors)
    return stats.outputs


def _restart_under_load(router, servers) -> tuple[soak.LoadStats, list[dict]]:
    done = threading.Event()
    result: dict = {}

    def restarts():
        try:
            result["steps"] = soak.rolling_restart(router.url, servers)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=restarts)
    t.start()
    stats = asyncio.run(soak.run_load(router.url, stop_when=done.is_set, **LOAD))
    t.join(60)
    if "error" in result:
        raise result["error"]
    return stats, result["steps"]


def _check(pd22, reference, pool: str) -> None:
    ps, ds, r = pd22
    stats, steps = _restart_under_load(r, ps if pool == "prefill" else ds)
    c = stats.counts
    assert c["completed"] == stats.sent and stats.sent > 0, (c, stats.errors)
    assert stats.bad_token_counts == 0
    for key, out in stats.outputs.items():
        assert out == reference[key], f"{key[1]} new tokens of a {len(key[0])}-token prompt differ"
    for step in steps:
        assert step["exit_code"] == 0, (step, [s.log() for s in ps + ds if s.name == step["name"]])
        assert step["busy_at_sigterm"] > 0, step  # the drain had something to finish
    for s in ps + ds:
        # a prefill leg whose decode was restarted under it ends by the stand's own timeouts (waiting
        # 20 s, heartbeat 3 s): 20 s of waiting was once not enough in CI (2 prefill legs still in flight)
        s.wait_unleaked(timeout=60)
    print(f"rolling restart of the {pool} pool: {stats.sent} requests, steps {steps}")


def test_decode_pool_rolling_restart_loses_nothing(pd22, reference):
    _check(pd22, reference, "decode")


def test_prefill_pool_rolling_restart_loses_nothing(pd22, reference):
    _check(pd22, reference, "prefill")
