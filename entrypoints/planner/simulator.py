"""Replays a request trace against prefill and decode servers modelled by profiles, with the SLA
planner in the loop through the ``virtual`` connector (or a static cluster), and reports SLO
attainment and server-seconds over time.

The model of the servers (a discrete-event simulation, one clock):
- a prefill server serves prompts one at a time, FIFO, each taking the profile's TTFT for its
  input length x ``prefill_speed``; the router sends a prompt to the server with the shortest queue;
- a decode server runs its batch in steps; a step of ``b`` sequences takes the profile's ITL at
  (``b``, their mean context) x ``decode_speed``, and gives each sequence one token; a sequence
  whose prefill finished joins at the next step boundary (the router picks the decode server with
  the fewest sequences); the first token comes from the prefill;
- a new server serves ``startup_s`` after it was asked for and costs from the moment it was asked
  for; a server scaled down is drained (no new requests, the ones it holds finish) and costs until
  it is empty. A scale-down takes servers still starting first, then the least loaded.

A request meets the SLO when its TTFT and its mean ITL both do. ``prefill_speed`` and
``decode_speed`` make the simulated servers slower than their profile, which the planner's
correction factors must discover.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

import msgspec

from pdserve.entrypoints.planner.connector import VirtualConnector
from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel
from pdserve.entrypoints.planner.profile import Profile
from pdserve.entrypoints.planner.scaling import Counts, Slo
from pdserve.entrypoints.planner.sla_planner import Observation, SlaPlanner
from pdserve.entrypoints.planner.trace import Request


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    slo: Slo
    interval_s: float = 30.0  # the planner's --adjustment-interval
    startup_s: float = 30.0  # from asking for a server until it serves
    prefill_speed: float = 1.0  # the simulated servers' time / the profile's
    decode_speed: float = 1.0


class Sample(msgspec.Struct, frozen=True, array_like=True):
    """One adjustment interval."""

    t: float
    rate: float  # arrivals per second in the interval
    prefill: int  # servers alive (starting or serving), draining ones excluded
    decode: int
    cost: float  # servers costing now (draining included)
    attainment: float  # of the requests finished in the interval (1.0 when none)


class SimResult(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    attainment: float
    ttft_attainment: float
    itl_attainment: float
    server_seconds: float
    duration_s: float
    samples: list[Sample]
    decisions: int  # planner targets recorded by the virtual connector


_ARRIVE, _PDONE, _DSTEP, _READY, _TICK = range(5)


class _Server:
    __slots__ = ("role", "sid", "state", "asked_at", "stopped_at", "queue", "busy", "batch", "pending", "k",
                 "base_ctx", "stepping")

    def __init__(self, role: str, sid: int, now: float, ready: bool):
        self.role, self.sid = role, sid
        self.state = "active" if ready else "starting"
        self.asked_at, self.stopped_at = now, None
        self.queue: deque[int] = deque()  # prefill: waiting prompts
        self.busy = False
        self.batch: list[tuple[int, int]] = []  # decode: heap of (finish step, request)
        self.pending: list[int] = []  # decode: joining at the next step
        self.k = 0  # decode steps done
        self.base_ctx = 0  # sum over the batch of (input_len - join step): context = base + b k
        self.stepping = False

    def load(self) -> int:
        if self.role == "prefill":
            return len(self.queue) + self.busy
        return len(self.batch) + len(self.pending)


class _Sim:
    def __init__(self, trace: list[Request], prefill_profile: Profile, decode_profile: Profile,
                 config: SimConfig, initial: Counts):
        self.trace, self.config = trace, config
        self.pm, self.dm = PrefillModel(prefill_profile), DecodeModel(decode_profile)
        n = len(trace)
        self.ttft = [float("inf")] * n
        self.join_t = [0.0] * n
        self.itl = [float("inf")] * n
        self.events: list = []
        self.seq = itertools.count()
        self.servers: dict[str, list[_Server]] = {"prefill": [], "decode": []}
        self.ids = itertools.count()
        self.waiting: dict[str, deque[int]] = {"prefill": deque(), "decode": deque()}
        self.now = 0.0
        self.done = 0
        # the interval's figures
        self.iv_arrivals: list[int] = []
        self.iv_first: list[int] = []
        self.iv_finished: list[int] = []
        self.iv_bb = self.iv_b = 0  # sums over decode steps of b^2 and b: the token-weighted batch
        for role, count in (("prefill", initial.prefill), ("decode", initial.decode)):
            for _ in range(count):
                self.servers[role].append(_Server(role, next(self.ids), 0.0, ready=True))

    def push(self, t: float, kind: int, obj=None) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj))

    # --- routing -------------------------------------------------------------------------------
    def active(self, role: str) -> list[_Server]:
        return [s for s in self.servers[role] if s.state == "active"]

    def route(self, role: str, req: int) -> None:
        servers = self.active(role)
        if not servers:
            self.waiting[role].append(req)
            return
        s = min(servers, key=_Server.load)
        if role == "prefill":
            s.queue.append(req)
            if not s.busy:
                self.start_prefill(s)
        else:
            s.pending.append(req)
            if not s.stepping:
                self.start_step(s)

    def start_prefill(self, s: _Server) -> None:
        req = s.queue.popleft()
        s.busy = True
        self.push(self.now + self.pm.ttft(self.trace[req].input_len) * self.config.prefill_speed, _PDONE, (s, req))

    def start_step(self, s: _Server) -> None:
        for req in s.pending:
            r = self.trace[req]
            self.join_t[req] = self.now
            if r.output_len <= 1:
                self.finish(req, self.now, 0)
                continue
            heapq.heappush(s.batch, (s.k + r.output_len - 1, req))
            s.base_ctx += r.input_len - s.k
        s.pending.clear()
        b = len(s.batch)
        if not b:
            s.stepping = False
            self.maybe_stop(s)
            return
        s.stepping = True
        self.iv_bb += b * b
        self.iv_b += b
        ctx = s.base_ctx / b + s.k
        self.push(self.now + self.dm.itl(b, ctx) * self.config.decode_speed, _DSTEP, s)

    def finish(self, req: int, t: float, steps: int) -> None:
        self.itl[req] = (t - self.join_t[req]) / steps if steps else 0.0
        self.iv_finished.append(req)
        self.done += 1

    def maybe_stop(self, s: _Server) -> None:
        if s.state == "draining" and not s.load():
            s.state, s.stopped_at = "stopped", self.now

    # --- scaling --------------------------------------------------------------------------------
    def alive(self, role: str) -> list[_Server]:
        return [s for s in self.servers[role] if s.state in ("starting", "active")]

    def scale(self, target: Counts) -> None:
        for role, want in (("prefill", target.prefill), ("decode", target.decode)):
            alive = self.alive(role)
            for _ in range(want - len(alive)):
                s = _Server(role, next(self.ids), self.now, ready=False)
                self.servers[role].append(s)
                self.push(self.now + self.config.startup_s, _READY, s)
            if want < len(alive):
                order = sorted(alive, key=lambda s: (s.state == "active", s.load(), -s.asked_at))
                for s in order[:len(alive) - want]:
                    if s.state == "starting":
                        s.state, s.stopped_at = "stopped", self.now
                    else:
                        s.state = "draining"
                        self.maybe_stop(s)

    def cost_now(self) -> int:
        return sum(1 for ss in self.servers.values() for s in ss if s.state != "stopped")

    def observe(self, interval: float, served: Counts) -> Observation:
        arr = self.iv_arrivals
        fin = self.iv_finished
        tr = self.trace

        def mean(xs):
            return sum(xs) / len(xs) if xs else None

        return Observation(
            interval_s=interval, rate=len(arr) / interval,
            input_len=mean([tr[i].input_len for i in arr]), output_len=mean([tr[i].output_len for i in fin]),
            ttft_s=mean([self.ttft[i] for i in self.iv_first]),
            itl_s=mean([self.itl[i] for i in fin if tr[i].output_len > 1]),
            prefill_servers=served.prefill, decode_servers=served.decode,
            decode_batch=self.iv_bb / self.iv_b if self.iv_b else None,
            prefill_queue=float(sum(len(s.queue) for s in self.servers["prefill"]) + len(self.waiting["prefill"])))

    # --- run ------------------------------------------------------------------------------------
    def run(self, planner: SlaPlanner | None, connector: VirtualConnector | None) -> list[Sample]:
        for i, r in enumerate(self.trace):
            self.push(r.arrival_s, _ARRIVE, i)
        interval = self.config.interval_s
        self.push(interval, _TICK)
        samples = []
        slo = self.config.slo
        n = len(self.trace)
        while self.events:
            t, _, kind, obj = heapq.heappop(self.events)
            self.now = t
            if kind == _ARRIVE:
                self.iv_arrivals.append(obj)
                self.route("prefill", obj)
            elif kind == _PDONE:
                s, req = obj
                s.busy = False
                self.ttft[req] = t - self.trace[req].arrival_s
                self.iv_first.append(req)
                self.route("decode", req)
                if s.queue:
                    self.start_prefill(s)
                else:
                    self.maybe_stop(s)
            elif kind == _DSTEP:
                s = obj
                s.k += 1
                while s.batch and s.batch[0][0] <= s.k:
                    _, req = heapq.heappop(s.batch)
                    s.base_ctx -= self.trace[req].input_len - (s.k - self.trace[req].output_len + 1)
                    self.finish(req, t, self.trace[req].output_len - 1)
                self.start_step(s)
            elif kind == _READY:
                if obj.state == "starting":
                    obj.state = "active"
                    for role in ("prefill", "decode"):
                        while self.waiting[role] and self.active(role):
                            self.route(role, self.waiting[role].popleft())
            elif kind == _TICK:
                obs = self.observe(interval, Counts(len(self.active("prefill")), len(self.active("decode"))))
                fin = self.iv_finished
                ok = sum(1 for i in fin if self.ttft[i] <= slo.ttft_s and self.itl[i] <= slo.itl_s)
                if planner is not None:
                    alive = Counts(len(self.alive("prefill")), len(self.alive("decode")))
                    step = planner.step(t, obs, alive)
                    connector.apply(step.decision.counts)
                    self.scale(connector.current())
                samples.append(Sample(t, obs.rate, len(self.alive("prefill")), len(self.alive("decode")),
                                      self.cost_now(), ok / len(fin) if fin else 1.0))
                self.iv_arrivals, self.iv_first, self.iv_finished = [], [], []
                self.iv_bb = self.iv_b = 0
                if self.done < n:
                    self.push(t + interval, _TICK)
        return samples

    def server_seconds(self, end: float) -> float:
        return sum((s.stopped_at if s.stopped_at is not None else end) - s.asked_at
                   for ss in self.servers.values() for s in ss)


def simulate(trace: list[Request], prefill_profile: Profile, decode_profile: Profile, config: SimConfig,
             planner: SlaPlanner | None = None, static: Counts | None = None) -> SimResult:
    """Run the trace through the planner (``planner``, starting from its counts) or a ``static``
    cluster; every request runs to its end."""
    if (planner is None) == (static is None):
        raise ValueError("give a planner or a static cluster, not both")
    initial = planner.counts if planner is not None else static
    sim = _Sim(trace, prefill_profile, decode_profile, config, initial)
    connector = VirtualConnector(initial) if planner is not None else None
    samples = sim.run(planner, connector)
    end = samples[-1].t if samples else 0.0
    slo = config.slo
    n = len(trace)
    ttft_ok = [sim.ttft[i] <= slo.ttft_s for i in range(n)]
    itl_ok = [sim.itl[i] <= slo.itl_s for i in range(n)]
    return SimResult(
        requests=n, attainment=sum(a and b for a, b in zip(ttft_ok, itl_ok)) / max(n, 1),
        ttft_attainment=sum(ttft_ok) / max(n, 1), itl_attainment=sum(itl_ok) / max(n, 1),
        server_seconds=sim.server_seconds(end), duration_s=end, samples=samples,
        decisions=len(connector.history) if connector else 0)
