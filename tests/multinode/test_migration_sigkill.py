"""Request migration for real: a decode server SIGKILLed under 16 concurrent greedy streams.

One stand: a prefill and two decode servers of the default model, and two
routers in front of the same servers, one with ``--migration-limit 2`` and one
without migration. The 16 streams run once without a fault (the reference),
then again, with 4 streams through the router without migration at the same
time, and the first decode server is SIGKILLed once every stream has tokens.
Through the migrating router every stream completes, equal token for token to
the reference, each event extending the last (no token repeated or lost), with
the whole answer counted once in ``meta_info``; through the other router the
streams on the killed server end with today's error event.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import requests
from pd_stand import InProcessRouter, Server, prompt_ids, serving

from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(400)

N_STREAMS, N_PLAIN, MAX_NEW = 16, 4, 40
LOAD_KV = ["--disaggregation-bootstrap-timeout", "120", "--disaggregation-waiting-timeout", "120"]


def body(i: int) -> dict:
    return {"input_ids": prompt_ids(12 + i, seed=100 + i), "stream": True,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}


class Stream(threading.Thread):
    """One streamed /generate: its events (decoded), their arrival times, and the route headers."""

    def __init__(self, port: int, i: int):
        super().__init__(daemon=True)
        self.port, self.i = port, i
        self.events: list[dict] = []
        self.times: list[float] = []
        self.headers: dict = {}
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with requests.post(f"http://127.0.0.1:{self.port}/generate", json=body(self.i), stream=True,
                               timeout=300) as r:
                assert r.status_code == 200, r.text
                self.headers = dict(r.headers)
                for line in r.iter_lines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        self.events.append(msgspec.json.decode(line[6:]))
                        self.times.append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    @property
    def ids(self) -> list[int]:
        good = [e for e in self.events if "error" not in e]
        return good[-1]["output_ids"] if good else []

    @property
    def text(self) -> str:
        good = [e for e in self.events if "error" not in e]
        return good[-1]["text"] if good else ""


@pytest.fixture(scope="module")
def stand():
    servers = {"p": Server("mig-P", "prefill", "--max-total-tokens", "4096", *LOAD_KV),
               "d1": Server("mig-D1", "decode", "--max-total-tokens", "4096", *LOAD_KV),
               "d2": Server("mig-D2", "decode", "--max-total-tokens", "4096", *LOAD_KV)}
    with serving(servers) as s:
        p, d1, d2 = s["p"], s["d1"], s["d2"]
        common = dict(prefill=(WorkerSpec(p.url, "prefill", p.bootstrap_port),),
                      decode=(WorkerSpec(d1.url, "decode"), WorkerSpec(d2.url, "decode")),
                      policy="round_robin", log_level="warning")
        migrating = InProcessRouter(RouterConfig(migration_limit=2, **common))
        plain = InProcessRouter(RouterConfig(**common))
        try:
            yield s, migrating, plain
        finally:
            migrating.close()
            plain.close()


def test_decode_sigkilled_mid_stream_streams_continue_token_for_token(stand):
    servers, migrating, plain = stand
    reference = [Stream(migrating.port, i) for i in range(N_STREAMS)]
    for t in reference:
        t.join(300)
    assert all(t.error is None and len(t.ids) == MAX_NEW for t in reference), \
        [(t.error, len(t.ids)) for t in reference]

    streams = [Stream(migrating.port, i) for i in range(N_STREAMS)]
    plains = [Stream(plain.port, i) for i in range(N_PLAIN)]
    deadline = time.monotonic() + 200
    while not all(len(t.events) >= 2 or not t.is_alive() for t in streams + plains):
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.01)
    t_kill = time.perf_counter()
    servers["d1"].kill()  # SIGKILL to its process group
    for t in streams + plains:
        t.join(300)
        assert not t.is_alive() and t.error is None, t.error

    d1 = servers["d1"].url
    migrated = 0
    gaps = []
    for t, ref in zip(streams, reference):
        assert not any("error" in e for e in t.events), (t.i, t.events[-1])
        assert t.ids == ref.ids, (t.i, t.headers.get("x-pdserve-decode"))
        for a, b in zip(t.events, t.events[1:]):  # every event extends the last: nothing repeated
            assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"], (t.i, a, b)
        meta = t.events[-1]["meta_info"]
        assert meta["completion_tokens"] == MAX_NEW and meta["prompt_tokens"] == len(body(t.i)["input_ids"])
        assert meta["finish_reason"] is not None
        moved = [k for k, e in enumerate(t.events) if e["meta_info"].get("pdserve_migrations")]
        if moved:
            migrated += 1
            assert t.headers["x-pdserve-decode"].startswith(d1) and meta["pdserve_migrations"] == 1
            assert meta["id"] == t.events[0]["meta_info"]["id"]  # the request keeps its id
            k = moved[0]
            gaps.append(t.times[k] - max(t.times[k - 1], t_kill))
            # text: what went out before the move is the reference's; after it, equal unless a
            # character's bytes straddle the move (the new server decodes its half alone: U+FFFD)
            assert ref.text.startswith(t.events[k - 1]["text"]), (t.i, t.events[k - 1]["text"], ref.text)
            assert t.text == ref.text or "\ufffd" in t.text[len(t.events[k - 1]["text"]):], (t.i, t.text, ref.text)
        else:
            assert t.text == ref.text, (t.i, t.text, ref.text)
    assert migrated >= 1, "no stream was on the killed decode server mid-stream"
    counted = [line for line in migrating.router.metrics.render().decode().splitlines()
               if line.startswith("pdserve_router_migrations_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in counted if 'outcome="migrated"' in line) == migrated, \
        counted

    # without migration the same fault ends the killed server's streams with today's error event
    on_d1 = [t for t in plains if t.headers.get("x-pdserve-decode", "").startswith(d1)]
    assert on_d1
    for t in on_d1:
        assert "failed mid-stream" in t.events[-1]["error"]["message"], t.events[-1]
    for t in plains:
        if t not in on_d1:
            assert t.ids == reference[t.i].ids
    print(f"\nmigrated {migrated}/{N_STREAMS} streams, 0 failed; next token after the kill: "
          f"max {max(gaps) * 1e3:.0f} ms, median {sorted(gaps)[len(gaps) // 2] * 1e3:.0f} ms")
    servers["p"].wait_unleaked()
    servers["d2"].wait_unleaked()
