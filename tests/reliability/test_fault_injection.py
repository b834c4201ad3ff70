"""A transfer error injected at the adapter boundary fails only its room.

The prefill server runs with ``--disaggregation-transfer-backend fault_injection_engine:faulty_mooncake``
(an external backend factory, imported from this folder through ``PYTHONPATH``): the real Mooncake
engine wrapped in ``FaultInjectingEngine``, which fails 40% of batch writes (seeded) with
``TransferFailedError``; the decode server runs plain ``mooncake``. Every request either succeeds with all its tokens or fails on both
legs with a message naming its room and the injected fault; both servers stay healthy and every
page returns to the free list on both sides.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path

import pytest
import requests
from pd_stand import Server, greedy_body, new_room, pd_post, prompt_ids

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 4
FAULTY = "fault_injection_engine:faulty_mooncake"  # RATE 0.4, SEED 7


@pytest.fixture(scope="module")
def faulty_pair():
    # the server and its spawned scheduler ranks import the factory by name from this folder
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")]))
    p = Server("rel-inj-P", "prefill", "--max-total-tokens", "2048", backend=FAULTY, env={"PYTHONPATH": path})
    d = Server("rel-inj-D", "decode", "--max-total-tokens", "2048")
    try:
        yield p.wait_ready(), d.wait_ready()
    finally:
        p.stop()
        d.stop()


def test_injected_transfer_faults_fail_only_their_rooms(faulty_pair):
    P, D = faulty_pair
    # 1..2 chunks each (64-token chunks): a long prompt makes more writes, each a chance to fail
    jobs = [(prompt_ids(n, seed=i), new_room()) for i, n in enumerate([5, 20, 40, 70, 9, 30, 3, 50, 12, 66, 25, 8])]
    with cf.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda j: (j[1], *pd_post(P, D, "/generate", greedy_body(j[0], MAX_NEW), room=j[1])),
                              jobs))
    ok, failed = [], []
    for room, p, d in results:
        assert not isinstance(p, Exception) and not isinstance(d, Exception), (p, d)
        if d.status_code == 200:
            assert p.status_code == 200, p.text
            assert len(d.json()["output_ids"]) == MAX_NEW
            ok.append(room)
        else:
            failed.append(room)
            # both legs end with a JSON error that names the room's transfer and the fault
            for leg in (p, d):
                assert 400 <= leg.status_code < 600, leg.text
                msg = leg.json()["error"]["message"]
                assert "KV transfer failed" in msg, msg
                assert f"room {room}" in msg or leg is d, msg
            assert "injected transfer fault" in p.json()["error"]["message"]
            assert str(room) in p.json()["error"]["message"]
    assert ok and failed, f"with rate 0.4 over {len(jobs)} rooms expected both outcomes: ok={ok} failed={failed}"
    for s in (P, D):
        assert requests.get(s.url + "/health", timeout=5).status_code == 200
        s.wait_unleaked()
    # a follow-up request still works (retry until one draw passes: the rate stays 0.4)
    for i in range(10):
        _, d = pd_post(P, D, "/generate", greedy_body(prompt_ids(6, seed=100 + i), MAX_NEW))
        if d.status_code == 200:
            break
    assert d.status_code == 200, d.text


def test_injection_is_off_by_default():
    """Fault injection is no part of the package: no config field, no module; only the external spec."""
    import importlib.util

    from pdserve.entrypoints.flags import parse_serve_args
    from pdserve.engine.server_config import ServerConfig
    from pdserve.engine.kv_transfer_config import KVTransferConfig

    def faulty(name: str) -> bool:  # a word of the name, so that sampling_defaults does not count
        return any(word.startswith("fault") for word in name.split("_"))

    assert not any(faulty(name) for name in KVTransferConfig.field_names())
    assert not any(faulty(name) for name in ServerConfig.server_field_names())
    assert ServerConfig().kv_transfer_config().backend == "mooncake"
    assert importlib.util.find_spec("pdserve.kvtransfer.fault_injection") is None
    assert parse_serve_args(["--disaggregation-transfer-backend", FAULTY]).kv_transfer.backend == FAULTY
    with pytest.raises(SystemExit):  # a misspelt spec is a usage error before anything starts
        parse_serve_args(["--disaggregation-transfer-backend", "fault_injection_engine:faulty_mooncak"])
    from fault_injection_engine import FaultInjectingEngine

    with pytest.raises(ValueError, match="rate"):
        FaultInjectingEngine(object(), 1.5)


def test_faulty_engine_fails_writes_with_a_typed_error_at_the_seeded_rate():
    from pdserve.kvtransfer.errors import TransferFailedError
    from fault_injection_engine import FaultInjectingEngine
    from pdserve.kvtransfer.engines.transfer_engine import TransferState

    class Inner:  # only the write path is exercised; the real engines are covered by the PD tests
        name = "fake"
        supports_notifications = False

        def write(self, *a):
            self.writes = getattr(self, "writes", 0) + 1

    eng = FaultInjectingEngine(Inner(), 0.25, seed=3)
    errors = 0
    for _ in range(400):
        try:
            eng.write("peer", [1], [2], [3])
        except TransferFailedError as e:
            errors += 1
            assert "injected transfer fault" in str(e) and "peer" in str(e)
    assert errors == eng.injected and 60 < errors < 140
    h = FaultInjectingEngine(Inner(), 1.0).write_batch("peer", [1], [2], [3])
    assert h.state is TransferState.FAILED and isinstance(h.error, TransferFailedError)
