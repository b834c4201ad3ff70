"""The decode rank's peer directory: the prefill DP ranks its rooms come from.

Life cycle of a prefill peer (one per bootstrap host, port and DP rank, SGLang's connection pool
entry): resolving (its bootstrap server is asked for the route, ``GET /route``, retried while not
every prefill rank registered yet) -> registering (the route passed the checks: layout, backend,
TP split; this rank's pool was sent to each source with ``RegisterPool``) -> ready (every source
answered ``RegisterAck``), or failed (a check, a rejection, or heartbeats unanswered). While
registering or ready it is heartbeated; a peer whose source stops answering fails and is dropped,
and a ``DeadCheck`` probes its bootstrap server until it is known gone (its engine connection torn
down, its failed rooms then closed) or the quarantine timeout covers its rooms. A failed peer with
no rooms left is forgotten, so that new rooms look it up anew.

Owns the ``PrefillPeer`` records, the route checks, the heartbeat and dead-peer decisions. The
bootstrap lookups and probes (``fetch_route``, ``probe_dead``) are blocking calls the manager runs
on its lookup threads; everything else is called on the control thread and sends nothing itself.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

import pdserve.kvtransfer.messages as m
from pdserve.kvtransfer.bootstrap_client import fetch_rank, fetch_topology
from pdserve.kvtransfer.head_slices import TPPlace, layout_mismatch, slices_into
from pdserve.kvtransfer.engines.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)

LOOKUP_RETRY_S = 0.2
# a bootstrap host that did not answer (refused, timed out, unreachable) is not asked again for
# this long, doubling from the first value per failure in a row: a dead or bogus host costs the
# lookup threads one call per backoff, and the other hosts' lookups go on meanwhile
HOST_BACKOFF_S = (0.2, 10.0)

PeerKey = tuple[str, int, int]  # (bootstrap_host, bootstrap_port, prefill dp rank)


@dataclass
class PrefillPeer:
    """A prefill DP rank: the TP ranks of it this decode rank takes heads from (its sources)."""

    key: PeerKey
    state: str = "resolving"  # resolving -> registering -> ready | failed
    reason: str | None = None
    routes: dict[int, m.RankRegistration] = field(default_factory=dict)  # source tp rank -> its registration
    acked: set[int] = field(default_factory=set)  # sources that accepted this pool
    # the prefill engines, where the backend needs them known (nixl notifications)
    engine_peers: dict[int, str] = field(default_factory=dict)
    receivers: set[int] = field(default_factory=set)
    next_lookup: float = 0.0
    lookup_inflight: bool = False
    lookup_detail: str = ""  # why the last lookup found no route (the bootstrap server's 503 names missing ranks)
    last_ack: dict[int, float] = field(default_factory=dict)  # per source
    # per source: heartbeats sent since its last reply. A peer fails on heartbeats this rank really
    # sent and got no reply to, not on the wall clock alone: a stall of this rank's own control
    # thread (seen: 3.4 s on a loaded 2-core host) sends nothing, so it must not fail a live peer
    unanswered: dict[int, int] = field(default_factory=dict)
    last_beat: float = 0.0
    seq: int = 0
    # per source TP rank: its transfer-engine peer info (RegisterAck), to retire it when dead
    engine_infos: dict[int, bytes] = field(default_factory=dict)

    @property
    def sources(self) -> frozenset[int]:
        return frozenset(self.routes)

    @property
    def endpoints(self) -> list[str]:
        return [r.endpoint for r in self.routes.values()]

    def source_of(self, endpoint: str) -> int | None:
        return next((tp for tp, r in self.routes.items() if r.endpoint == endpoint), None)

    def describe(self) -> str:
        host, port, dp = self.key
        eps = ", ".join(f"tp {tp} {r.endpoint}" for tp, r in self.routes.items())
        return f"prefill dp {dp} (bootstrap {host}:{port}{', ' + eps if eps else ''})"


@dataclass
class DeadCheck:
    """A prefill peer that stopped answering heartbeats. Probed at its bootstrap server until it is
    known dead (then its connection is torn down and its failed rooms closed) or the quarantine
    timeout covers its rooms anyway (a peer that is merely silent)."""

    peer: PrefillPeer
    since: float
    next_probe: float = 0.0
    probing: bool = False
    release_at: float | None = None  # set once dead: when its rooms count as closed


def fetch_route(key: PeerKey) -> m.Topology:
    """Lookup thread: the prefill server's topology from its bootstrap server."""
    host, port, _ = key
    return fetch_topology(host, port)


def probe_dead(peer: PrefillPeer, engine: TransferEngine) -> tuple[bool, bool]:
    """Lookup thread: (dead, torn_down). Dead: its bootstrap server refuses connections (the prefill
    server process, which owns its ranks, is gone) or no longer lists it at the same endpoint
    (restarted). Then its transfer-engine connection is torn down here before anything is released."""
    host, port, dp = peer.key
    try:
        routes = {tp: fetch_rank(host, port, dp, tp) for tp in peer.routes}
    except urllib.error.HTTPError as e:
        dead = e.code in (404, 503)
    except urllib.error.URLError as e:
        dead = isinstance(e.reason, ConnectionRefusedError)
    except ConnectionRefusedError:
        dead = True
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, json.JSONDecodeError):
        dead = False  # unreachable or garbled is not gone: a partitioned prefill may still write
    else:
        dead = any(routes[tp].endpoint != route.endpoint for tp, route in peer.routes.items())
    if not dead:
        return False, False
    infos = [info for info in peer.engine_infos.values() if info]
    return True, bool(infos) and all([engine.retire_peer(info) for info in infos])


class PrefillPeers:
    def __init__(self, tp: TPPlace, kv_heads: int, layout: m.LayoutInfo, backend: str, decode_id: str,
                 endpoint: str, clock: Callable[[], float]):
        """This rank's side of the route checks (its TP place, ``kv_heads`` of the model, its pool's
        ``layout``, its engine's ``backend``), its id and control endpoint (in its heartbeats), and
        the manager's ``clock`` (heartbeat windows)."""
        self.tp = tp
        self.kv_heads = kv_heads
        self.layout = layout
        self.backend = backend
        self.decode_id = decode_id
        self.endpoint = endpoint
        self.clock = clock
        self.peers: dict[PeerKey, PrefillPeer] = {}
        self.dead_checks: list[DeadCheck] = []
        # per bootstrap (host, port): a lookup in flight (at most one per host), and the negative
        # cache of hosts that did not answer: (not before, failures in a row)
        self.host_busy: set[tuple[str, int]] = set()
        self.host_down: dict[tuple[str, int], tuple[float, int]] = {}

    def peer(self, key: PeerKey) -> PrefillPeer:
        """The peer of ``key``, new (resolving) if unknown."""
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = PrefillPeer(key)
        return peer

    def is_current(self, peer: PrefillPeer) -> bool:
        return self.peers.get(peer.key) is peer

    # ------------------------------------------------------------- lookups
    def lookup_due(self, peer: PrefillPeer) -> bool:
        """A lookup of ``peer`` should start now (then it counts as in flight)."""
        if peer.state != "resolving" or peer.lookup_inflight or time.monotonic() < peer.next_lookup or not peer.receivers:
            return False
        host = peer.key[:2]
        if host in self.host_busy or time.monotonic() < self.host_down.get(host, (0.0, 0))[0]:
            return False
        peer.lookup_inflight = True
        self.host_busy.add(host)
        return True

    def lookup_ended(self, peer: PrefillPeer, unreachable: bool) -> None:
        """A lookup of ``peer`` returned (whatever became of the peer): its host is free for the next
        one; ``unreachable`` (no HTTP answer) puts the host in the negative cache, backing off."""
        host = peer.key[:2]
        self.host_busy.discard(host)
        if not unreachable:
            self.host_down.pop(host, None)
            return
        fails = self.host_down.get(host, (0.0, 0))[1] + 1
        delay = min(HOST_BACKOFF_S[0] * 2 ** (fails - 1), HOST_BACKOFF_S[1])
        self.host_down[host] = (time.monotonic() + delay, fails)

    def lookup_failed(self, peer: PrefillPeer, exc: BaseException) -> str | None:
        """A lookup raised ``exc``: the reason the peer fails, or None when it is retried (the bootstrap
        server is not up yet, or not every prefill rank registered: its rooms time out otherwise).
        Anything but the bootstrap client's errors is raised again."""
        peer.lookup_inflight = False
        if isinstance(exc, urllib.error.HTTPError):
            detail = exc.read().decode(errors="replace")
            peer.lookup_detail = f"bootstrap server answered HTTP {exc.code}: {detail}"
            logger.info("kv decode: lookup %s: HTTP %d %s", peer.describe(), exc.code, detail)
            if exc.code not in (503, 404):
                return f"bootstrap lookup of {peer.describe()} failed: HTTP {exc.code} {detail}"
        elif isinstance(exc, (OSError, msgspec.DecodeError, msgspec.ValidationError, json.JSONDecodeError)):
            logger.info("kv decode: lookup %s: %s", peer.describe(), exc)
        else:
            raise exc
        peer.next_lookup = time.monotonic() + LOOKUP_RETRY_S  # pacing, not a timeout: real time
        return None

    def accept_route(self, peer: PrefillPeer, route: m.Topology) -> str | None:
        """The prefill server's topology came: pick this rank's sources and check them. Returns the
        reason the peer fails; None: it is registering (send ``RegisterPool`` to every endpoint)."""
        peer.lookup_inflight = False
        dp = peer.key[2]
        ranks = {r.tp_rank: r for r in route.ranks if r.dp_rank == dp}
        if not ranks:
            return f"{peer.describe()}: no such DP rank (prefill dp_size {route.dp_size})"
        first = ranks[min(ranks)]
        their_heads = first.kv_heads or first.num_kv_heads
        try:
            sources = {s.src_rank for s in slices_into(self.tp.rank, route.tp_size, self.tp.size, self.kv_heads)}
        except ValueError as e:
            sources, split_error = {min(ranks)}, str(e)
        else:
            split_error = ""
        # known before any check fails, so that a failed room's abort reaches the prefill ranks too
        peer.routes = {tp: ranks[tp] for tp in sorted(sources)}
        diff = layout_mismatch(first.layout(), their_heads, self.layout, self.kv_heads)
        if diff:
            return diff
        if first.backend != self.backend:
            return f"transfer backend mismatch: prefill {first.backend} vs decode {self.backend}"
        if split_error:
            return f"{peer.describe()} TP {route.tp_size} vs decode TP {self.tp.size}: {split_error}"
        peer.state = "registering"
        now = self.clock()  # the heartbeat window starts now
        peer.last_ack = dict.fromkeys(peer.routes, now)
        peer.unanswered = dict.fromkeys(peer.routes, 0)
        return None

    # ------------------------------------------------------ registration acks
    def registering(self, endpoint: str) -> list[tuple[PrefillPeer, int]]:
        """(peer, source tp rank) of every registering peer with a source at ``endpoint``."""
        out = []
        for peer in [p for p in self.peers.values() if p.state == "registering"]:
            tp = peer.source_of(endpoint)
            if tp is not None:
                out.append((peer, tp))
        return out

    def acked(self, peer: PrefillPeer, tp: int, peer_info: bytes) -> bool:
        """Source ``tp`` accepted this pool; True when that made the peer ready."""
        peer.engine_infos[tp] = peer_info
        peer.acked.add(tp)
        self._answered(peer, tp)
        if peer.acked < peer.sources:
            return False
        peer.state = "ready"
        return True

    def _answered(self, peer: PrefillPeer, tp: int) -> None:
        peer.last_ack[tp] = self.clock()
        peer.unanswered[tp] = 0

    def fail(self, peer: PrefillPeer, reason: str) -> None:
        logger.warning("kv decode: %s", reason)
        peer.state, peer.reason = "failed", reason

    def drop(self, peer: PrefillPeer) -> None:
        """Forget ``peer``: the next room of its key looks it up anew."""
        self.peers.pop(peer.key, None)

    def forget_failed(self) -> None:
        """A failed peer (layout mismatch, rejected pool) is retried for new rooms later."""
        for key in [k for k, p in self.peers.items() if p.state == "failed" and not p.receivers]:
            del self.peers[key]

    # ------------------------------------------------------------ heartbeats
    def on_heartbeat_ack(self, endpoint: str) -> None:
        for peer in self.peers.values():
            tp = peer.source_of(endpoint)
            if peer.state in ("registering", "ready") and tp is not None:
                self._answered(peer, tp)

    def heartbeat(self, peer: PrefillPeer, now: float, window: float, max_failures: int,
                  interval: float) -> tuple[str | None, m.Heartbeat | None]:
        """(why the peer is unreachable, or the heartbeat to send to each of its endpoints now); both
        None when neither is due. An unreachable peer gets a ``DeadCheck`` from ``now``."""
        if peer.state not in ("registering", "ready"):
            return None, None
        tp, last = min(peer.last_ack.items(), key=lambda kv: kv[1])
        if now - last > window and peer.unanswered.get(tp, 0) >= max_failures:
            self.dead_checks.append(DeadCheck(peer, now))
            return (f"{peer.describe()} unreachable: no heartbeat reply from TP rank {tp} for {now - last:.1f}s "
                    f"({peer.unanswered[tp]} heartbeats unanswered, {max_failures} x {interval}s)"), None
        if now - peer.last_beat < interval:
            return None, None
        peer.last_beat = now
        peer.seq += 1
        for source in peer.routes:
            peer.unanswered[source] = peer.unanswered.get(source, 0) + 1
        return None, m.Heartbeat(self.decode_id, self.endpoint, peer.seq)

    # ------------------------------------------------ dead peers' quarantined rooms
    def check_dead(self, now: float, quarantine_timeout: float) -> tuple[list[PrefillPeer], list[DeadCheck]]:
        """(peers whose rooms are now closed, checks to probe now: marked probing)."""
        release, probe = [], []
        for check in list(self.dead_checks):
            if check.release_at is not None and now >= check.release_at:
                self.dead_checks.remove(check)
                release.append(check.peer)
            elif now - check.since > quarantine_timeout:
                self.dead_checks.remove(check)  # merely silent all along: the quarantine timer freed its rooms
            elif check.release_at is None and not check.probing and now >= check.next_probe:
                check.probing = True
                probe.append(check)
        return release, probe

    def on_probe(self, check: DeadCheck, dead: bool, torn_down: bool, interval: float) -> bool:
        """A probe's outcome; True when the peer's rooms are closed now (its connection is torn down)."""
        check.probing = False
        now = self.clock()
        if not dead:
            check.next_probe = now + interval
            return False
        # a backend that cannot tear the peer down: its process exit closed the connections; what
        # the kernel still buffered for them lands within a heartbeat interval
        check.release_at = now if torn_down else now + interval
        logger.warning("kv decode: %s is gone (bootstrap registration gone%s)", check.peer.describe(),
                       ", engine connection torn down" if torn_down else "")
        if torn_down:
            self.dead_checks.remove(check)
        return torn_down
