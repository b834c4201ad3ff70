"""What one KV manager (one DP rank's TP rank) counts of its rooms, for the server's /metrics.

The metrics live in the scheduler process, which has no HTTP endpoint: they are kept by
``prometheus-client`` in the manager's own ``CollectorRegistry`` and ``snapshot()`` turns them
into ``MetricFamily`` messages that the rank sends with its stats (``RankMetrics``, every TP
rank, when they changed); the front end serves them with ``dp_rank`` and ``tp_rank`` labels
(``engine/frontend/metrics.py``). Names: docs/ARCHITECTURE.md, "Metrics and the request log".

Durations are real time (``time.monotonic``), not the manager's clock, which tests move to fire
timeouts. A room's transfer latency is the time it spent Transferring on this side: prefill,
from its first chunk handed to the
transfer threads to its last write returned; decode, from its destination sent to its Success
(so it includes the prefill's queueing and compute of that room, as SGLang's decode transfer
queue time does). The exposed transfer time is the part of it after the prefill's compute
ended (the last chunk handed over): on a prefill, to its last write returned; on a decode, to
its Success. The decode cannot read the prefill's clock, so the prefill sends the duration it
measured (``RoomStatus.exposed_s``), and the decode adds what it measured from that message's
arrival to Success (an engine notification, the other TP sources): only the control message's
own flight time is missing, where a timestamp would carry the two hosts' clock offset.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.engine.messages import MetricFamily, MetricSample
from pdserve.kvtransfer.errors import failure_cause
from pdserve.kvtransfer.kv_poll import KVPoll

# transfer latencies: a 1-page room over shared memory takes ~100 us, a 16k-token room over TCP seconds
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0)
SUCCESS = "success"
FAILED = "failed"
NO_CAUSE = "none"  # the cause label of a room that succeeded


class RoomMetrics:
    def __init__(self, role: str, room_page_bytes: int):
        """``role``: prefill | decode; ``room_page_bytes``: the KV bytes one page of a room holds in
        this rank's pool, every layer's K and V (what a decode rank receives per page)."""
        self.role = role
        self.room_page_bytes = room_page_bytes
        self.registry = reg = CollectorRegistry()
        # ``side`` (prefill | decode) on the families both sides export, so that one query can
        # take the decode's exposed time whatever the scrape jobs are called
        self.rooms = Counter("pdserve_kv_rooms", "KV rooms ended, by side, final state and failure cause "
                             "(kvtransfer/errors.py FAILURE_CAUSES; none for success).",
                             ("side", "state", "cause"), registry=reg)
        if role == "prefill":
            self.bytes = Counter("pdserve_kv_transfer_sent_bytes", "KV bytes written to decode ranks "
                                 "(every layer's K and V; aux data not counted).", registry=reg)
        else:
            self.bytes = Counter("pdserve_kv_transfer_received_bytes", "KV bytes of rooms that landed "
                                 "here (every layer's K and V; aux data not counted).", registry=reg)
        self.latency = Histogram("pdserve_kv_transfer_latency_seconds",
                                 "Per room that succeeded: time Transferring on this side (prefill: first "
                                 "chunk queued to last write done; decode: destination sent to Success).",
                                 ("side",), buckets=TRANSFER_BUCKETS, registry=reg).labels(role)
        self.exposed = Histogram("pdserve_kv_transfer_exposed_seconds",
                                 "Per room that succeeded: time from the end of its prefill compute to the "
                                 "last write done (prefill) or to the room's Success (decode).",
                                 ("side",), buckets=TRANSFER_BUCKETS, registry=reg).labels(role)
        # SGLang's PD counters and last-room gauges, under its names (sglang:... -> pdserve_...)
        self.bootstrap_failed = Counter("pdserve_num_bootstrap_failed_reqs",
                                        "Rooms that failed before their transfer started.", registry=reg)
        self.transfer_failed = Counter("pdserve_num_transfer_failed_reqs",
                                       "Rooms that failed while transferring.", registry=reg)
        self.last_latency_ms = Gauge("pdserve_kv_transfer_latency_ms",
                                     "Transfer latency of the last room that succeeded, in ms.", registry=reg)
        self.last_speed = Gauge("pdserve_kv_transfer_speed_gb_s",
                                "KV bytes / transfer latency of the last room that succeeded, in GB/s.",
                                registry=reg)
        self.last_total_mb = Gauge("pdserve_kv_transfer_total_mb",
                                   "KV megabytes of the last room that succeeded.", registry=reg)
        self._success = self.rooms.labels(role, SUCCESS, NO_CAUSE)
        # collecting the registry costs 0.15-0.5 ms (measured here, load 16): the rank asks every
        # 50 ms while busy, so the last snapshot is kept until a count changes
        self._changes = 0  # bumped after each count, under _lock (transfer and control threads both count)
        self._lock = threading.Lock()
        self._snapshot: tuple[int, list[MetricFamily]] | None = None

    def on_written(self, room, nbytes: int) -> None:
        """Prefill, a transfer thread: ``nbytes`` of ``room``'s KV were written."""
        room.bytes_sent += nbytes
        self.bytes.inc(nbytes)
        self._changed()

    def on_done(self, room, state: KVPoll) -> None:
        """``room`` (a sender or receiver, still in its previous state) ends in ``state`` now."""
        try:
            self._count_end(room, state)
        finally:
            self._changed()

    def _changed(self) -> None:
        """After a count: a snapshot keyed by the new value has it."""
        with self._lock:
            self._changes += 1

    def _count_end(self, room, state: KVPoll) -> None:
        if state is KVPoll.Failed:
            self.rooms.labels(self.role, FAILED, failure_cause(room.failure_reason)).inc()
            (self.transfer_failed if room.state is KVPoll.Transferring else self.bootstrap_failed).inc()
            return
        self._success.inc()
        latency, exposed = room.spans(time.monotonic())
        if self.role == "decode":
            nbytes = len(room.dst_pages or ()) * self.room_page_bytes
            self.bytes.inc(nbytes)
        else:
            nbytes = room.bytes_sent
        if latency is None:
            return
        self.latency.observe(latency)
        self.exposed.observe(exposed)
        self.last_latency_ms.set(latency * 1e3)
        self.last_total_mb.set(nbytes / 1e6)
        if latency > 0:
            self.last_speed.set(nbytes / latency / 1e9)

    def snapshot(self) -> list[MetricFamily]:
        """Every family with its samples (the ``_created`` series left out, as the endpoints do)."""
        changes = self._changes  # read first: a change while collecting makes the next call collect again
        if self._snapshot is None or self._snapshot[0] != changes:
            families = [MetricFamily(f.name, f.type, f.documentation,
                                     [MetricSample(s.name, s.labels, s.value) for s in f.samples
                                      if not s.name.endswith("_created")])
                        for f in self.registry.collect()]
            self._snapshot = (changes, families)
        return self._snapshot[1]
