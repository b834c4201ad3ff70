"""Checks of ``--log-requests`` lines (``engine/sched/request_log.py``), shared by the in-process
test (``tests/metrics``) and the multi-process stand (``tests/pd``)."""

from __future__ import annotations

import json

LOGGER = "pdserve.requests"


def parse_log(text: str) -> list[dict]:
    """The request lines of a server's log (the JSON after ``pdserve.requests: ``)."""
    marker = LOGGER + ": "
    return [json.loads(line.split(marker, 1)[1]) for line in text.splitlines() if marker in line]


def join(records: list[dict]) -> dict[int, dict[str, dict]]:
    """bootstrap_room -> side -> its line."""
    out: dict[int, dict[str, dict]] = {}
    for line in records:
        out.setdefault(line["bootstrap_room"], {})[line["side"]] = line
    return out


def check_prefill_stages(stages: list[dict], min_chunks: int) -> None:
    """Ordered: queued, bootstrapped, each chunk computed before it is sent, success, finished.
    A chunk is a hand-off to the transfer threads: one per forward pass, and the last one."""
    names = [s["stage"] for s in stages]
    times = {(s["stage"], s.get("chunk")): s["t"] for s in stages}
    assert names[:2] == ["queued", "bootstrapped"] and names[-2:] == ["success", "finished"], names
    num_chunks = names.count("chunk_computed")
    assert num_chunks >= min_chunks
    assert sorted(s["chunk"] for s in stages if s["stage"] == "chunk_computed") == list(range(num_chunks))
    assert sorted(s["chunk"] for s in stages if s["stage"] == "chunk_sent") == list(range(num_chunks))
    for i in range(num_chunks):
        assert times[("bootstrapped", None)] <= times[("chunk_computed", i)] <= times[("chunk_sent", i)]
        assert times[("chunk_sent", i)] <= times[("success", None)]
    assert [s["t"] for s in stages] == sorted(s["t"] for s in stages)


def check_decode_stages(stages: list[dict]) -> None:
    assert [s["stage"] for s in stages] == ["queued", "preallocated", "kv_landed", "first_token", "finished"]
    assert [s["t"] for s in stages] == sorted(s["t"] for s in stages)


def check_joined(p: dict, d: dict) -> None:
    """Across the sides of one room: the decode preallocated before the prefill computed, and the KV
    landed after its last chunk was written."""
    t = {s["stage"]: s["t"] for s in d["stages"]}
    assert t["preallocated"] <= min(s["t"] for s in p["stages"] if s["stage"] == "chunk_computed")
    assert max(s["t"] for s in p["stages"] if s["stage"] == "chunk_sent") <= t["kv_landed"]
