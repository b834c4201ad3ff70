"""The scaling rule: from the profiles, the predicted load, the SLOs and the limits, how many
prefill and decode servers. Pure functions over plain values, tested as a table of cases.

Prefill. A prefill server serves prompts one after another; a prompt of the mean input length
takes ``s = ttft_profile(isl) x correction``. Each server is planned as an M/M/1 queue (prompt
lengths vary, and exponential service is the conservative stand-in; arrivals come in bursts), and
the SLO must hold for the ``quantile`` of requests (the attainment target, 95% by default), not on
average: at utilisation ``rho`` a prompt waits longer than ``t`` with probability
``rho exp(-(1 - rho) t / s)``. The largest ``rho`` (<= ``max_utilization``) whose TTFT quantile
meets the SLO is found by bisection, and the pool needs ``ceil(rate x s / rho)`` servers.

Decode. A decode server runs ``b`` sequences at a time at ``itl_profile(b, context) x correction``
per token, ``context`` being the input length plus half the output. The largest ``b`` that meets
the ITL SLO (and fits the KV capacity the profile states) bounds a server's batch; a server's
batch fluctuates about its mean by about its square root, so the mean planned is ``m`` with
``m + z_quantile sqrt(m) <= b``. By Little's law the pool holds ``rate x osl x itl(b)`` sequences
(or more: those in flight now, after a rise), so ``ceil(sequences / m)`` servers are enough; the
rule takes the fewest (bisection) whose predicted ITL at the batch's quantile still meets the SLO
(the batch ``b`` solves ``b = rate x osl x itl(b) / servers``), and never fewer than the
sequences in flight need.

Then the limits, in this order: the counts are clamped to [min, max] per role; a budget cap on the
cost (servers x TP size) shrinks the pools toward their minima, always taking from the role that
keeps the larger share of its need; and a role scales down only when its last change is at least
``cooldown`` seconds old (scaling up is never delayed: the SLO is at stake).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import msgspec

from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel

INF = float("inf")


class Slo(msgspec.Struct, frozen=True):
    ttft_s: float
    itl_s: float
    quantile: float = 0.95  # the share of requests that must meet both (the attainment target)

    def __post_init__(self):
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"SLOs must be > 0: ttft {self.ttft_s}, itl {self.itl_s}")
        if not 0.5 <= self.quantile < 1:
            raise ValueError(f"SLO quantile must be in [0.5, 1), got {self.quantile}")


class Load(msgspec.Struct, frozen=True):
    rate: float  # requests per second
    input_len: float  # mean prompt tokens
    output_len: float  # mean generated tokens
    # sequences the decode pool must hold now, whatever the rate says (those in flight, counted
    # at the ITL the SLO allows): after a rise they outnumber the rate's share for a while
    decode_inflight: float = 0.0


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    budget: float = INF  # the most cost (servers x their TP size) the pools may take together
    prefill_cost: float = 1.0  # cost of one prefill server (its TP size, or chips)
    decode_cost: float = 1.0
    cooldown_s: float = 60.0  # a role scales down only this long after its last change
    max_utilization: float = 0.85  # the highest load a server is planned at

    def __post_init__(self):
        if not 0 <= self.min_prefill <= self.max_prefill or not 0 <= self.min_decode <= self.max_decode:
            raise ValueError("need 0 <= min <= max for each role: "
                             f"prefill {self.min_prefill}..{self.max_prefill}, decode {self.min_decode}..{self.max_decode}")
        if self.min_prefill * self.prefill_cost + self.min_decode * self.decode_cost > self.budget:
            raise ValueError(f"budget {self.budget} is below the minimum pools' cost")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown must be >= 0, got {self.cooldown_s}")
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization must be in (0, 1], got {self.max_utilization}")


class Counts(msgspec.Struct, frozen=True):
    prefill: int
    decode: int


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    counts: Counts  # what to run now
    needed: Counts  # what the SLOs need, before limits, budget and cooldown
    reasons: tuple[str, ...] = ()  # why counts differ from needed (max, budget, cooldown, infeasible)


# --- prefill ------------------------------------------------------------------------------------

def prefill_service_s(model: PrefillModel, load: Load, correction: float = 1.0) -> float:
    return model.ttft(load.input_len) * correction


def ttft_quantile(service_s: float, rho: float, quantile: float) -> float:
    """The ``quantile`` of TTFT in an M/M/1 queue of mean service ``service_s`` at utilisation
    ``rho``: the wait exceeds ``t`` with probability ``rho exp(-(1 - rho) t / s)``."""
    if rho >= 1:
        return INF
    tail = 1.0 - quantile
    wait = 0.0 if rho <= tail else service_s / (1 - rho) * math.log(rho / tail)
    return service_s + wait


def max_prefill_utilization(service_s: float, ttft_slo: float, cap: float, quantile: float) -> float:
    """The highest utilisation (<= ``cap``) at which the TTFT ``quantile`` meets the SLO; 0 when
    one prompt alone already misses it."""
    if service_s >= ttft_slo:
        return 0.0
    if ttft_quantile(service_s, cap, quantile) <= ttft_slo:
        return cap
    lo, hi = 0.0, cap  # the quantile rises with rho: bisect
    for _ in range(50):
        mid = (lo + hi) / 2
        if ttft_quantile(service_s, mid, quantile) <= ttft_slo:
            lo = mid
        else:
            hi = mid
    return lo


def predict_ttft(model: PrefillModel, load: Load, servers: float, correction: float = 1.0,
                 quantile: float = 0.5) -> float:
    """TTFT ``quantile`` of the pool at this load, as planned (M/M/1); inf when it cannot keep up."""
    s = prefill_service_s(model, load, correction)
    if load.rate <= 0:
        return s
    if servers <= 0:
        return INF
    return ttft_quantile(s, load.rate * s / servers, quantile)


def mean_ttft_lower(model: PrefillModel, load: Load, servers: float) -> float:
    """Mean TTFT with every prompt of the mean length (M/D/1): the least queueing this load can
    have. Corrections compare with it, so that a factor above 1 is slowness or spread, never the
    planning model's own pessimism read as fast servers."""
    s = prefill_service_s(model, load)
    if servers <= 0:
        return INF
    rho = load.rate * s / servers
    return INF if rho >= 1 else s + rho * s / (2 * (1 - rho))


def needed_prefill(model: PrefillModel, load: Load, slo: Slo, correction: float, cap: float) -> int | None:
    """Servers the prefill SLO needs (None: no count meets it, a prompt alone is too slow)."""
    if load.rate <= 0:
        return 0
    s = prefill_service_s(model, load, correction)
    rho = max_prefill_utilization(s, slo.ttft_s, cap, slo.quantile)
    if rho <= 0:
        return None
    return math.ceil(load.rate * s / rho - 1e-9)


# --- decode -------------------------------------------------------------------------------------

def decode_context(load: Load) -> float:
    return load.input_len + load.output_len / 2


def token_batch(mean_batch: float) -> float:
    """The batch a generated token sees on average on a server whose batch is ``mean_batch`` on
    (time) average. Tokens come out in proportion to the batch, so the token-weighted mean batch
    is ``E[B^2] / E[B]``: the mean plus one for a Poisson batch (requests arriving at random). At
    low load this is what a request sees, itself plus the others, not a time-average below one
    (taking ``max(b, 1)`` there under-predicted the ITL of a real run by about the share of time a
    second sequence is in the batch: ``plan`` against a real run, docs/PLANNER.md)."""
    return mean_batch + 1.0


def predict_itl(model: DecodeModel, load: Load, servers: float, correction: float = 1.0,
                quantile: float | None = None) -> tuple[float, float]:
    """(ITL, mean batch per server) of the pool at this load: the mean batch ``b`` solves
    ``b = rate x osl x itl(b + 1) / servers`` (Little's law, each sequence at the ITL of the batch
    its tokens see, ``token_batch``); inf when no batch does (overload). The ITL is at that
    token-weighted batch, or with ``quantile`` at that quantile of the batch (``b + z sqrt(b)``,
    at least ``b + 1``, as the scaling rule plans)."""
    ctx = decode_context(load)
    if load.rate <= 0 or load.output_len <= 0:
        return model.itl(1, ctx) * correction, 0.0
    if servers <= 0:
        return INF, INF
    per_token = load.rate * load.output_len / servers  # sequences per unit of ITL
    b = 0.0
    for _ in range(200):
        nxt = per_token * model.itl(token_batch(b), ctx) * correction
        if abs(nxt - b) < 1e-6:
            break
        b = nxt
        if b > 1e5:
            return INF, INF
    seen = token_batch(b)
    if quantile is not None:
        seen = max(seen, b + max(0.0, NormalDist().inv_cdf(quantile)) * math.sqrt(b))
    return model.itl(seen, ctx) * correction, b


def planned_batch(max_batch: int, quantile: float, cap: float) -> float:
    """The mean batch to plan a decode server at: the batch of a server fluctuates about its mean
    (Poisson: by its square root), and its ``quantile`` must stay within ``max_batch``:
    ``m + z sqrt(m) <= max_batch``; and at most ``cap x max_batch``."""
    z = max(0.0, NormalDist().inv_cdf(quantile))
    m = ((-z + math.sqrt(z * z + 4 * max_batch)) / 2) ** 2
    return max(min(m, cap * max_batch), min(1.0, max_batch))


def needed_decode(model: DecodeModel, load: Load, slo: Slo, correction: float, cap: float) -> int | None:
    """Servers the ITL SLO needs (None: not even one sequence per server meets it): the fewest
    whose batch quantile's ITL meets the SLO with the mean batch within ``cap`` of the largest
    that meets it, and enough for the sequences in flight."""
    if (load.rate <= 0 or load.output_len <= 0) and load.decode_inflight <= 0:
        return 0
    ctx = decode_context(load)
    b = model.max_batch(slo.itl_s / correction, ctx)
    if b < 1:
        return None
    m = planned_batch(b, slo.quantile, cap)
    itl = model.itl(b, ctx) * correction
    hi = max(1, math.ceil(max(load.rate * load.output_len * itl, load.decode_inflight) / m - 1e-9))
    lo = max(1, math.ceil(load.decode_inflight / m - 1e-9))
    if load.rate <= 0 or load.output_len <= 0:
        return lo

    def meets(d: int) -> bool:
        got, batch = predict_itl(model, load, d, correction, slo.quantile)
        return got <= slo.itl_s and batch <= cap * b

    while lo < hi:  # the ITL falls as servers are added: bisect the fewest that meet it
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


# --- limits -------------------------------------------------------------------------------------

def _fit_budget(want: Counts, need: Counts, limits: Limits) -> Counts:
    """The largest counts <= ``want`` within the budget, grown from the minima one server at a
    time, each to the role with the smaller share of its ``need``."""
    p, d = limits.min_prefill, limits.min_decode
    left = limits.budget - p * limits.prefill_cost - d * limits.decode_cost
    while True:
        options = []
        if p < want.prefill and limits.prefill_cost <= left + 1e-9:
            options.append((p / max(need.prefill, 1), 0))
        if d < want.decode and limits.decode_cost <= left + 1e-9:
            options.append((d / max(need.decode, 1), 1))
        if not options:
            return Counts(p, d)
        _, role = min(options)
        if role == 0:
            p += 1
            left -= limits.prefill_cost
        else:
            d += 1
            left -= limits.decode_cost


def decide(prefill_model: PrefillModel, decode_model: DecodeModel, load: Load, slo: Slo, limits: Limits,
           current: Counts, since_change: tuple[float, float],
           corrections: tuple[float, float] = (1.0, 1.0)) -> Decision:
    """The counts to run next. ``since_change``: seconds since each role's (prefill, decode) last
    change; ``corrections``: (prefill TTFT, decode ITL) factors."""
    reasons = []
    need_p = needed_prefill(prefill_model, load, slo, corrections[0], limits.max_utilization)
    need_d = needed_decode(decode_model, load, slo, corrections[1], limits.max_utilization)
    if need_p is None:
        reasons.append("prefill: one prompt alone misses the TTFT SLO; max servers")
        need_p = limits.max_prefill
    if need_d is None:
        reasons.append("decode: one sequence alone misses the ITL SLO; max servers")
        need_d = limits.max_decode
    needed = Counts(need_p, need_d)
    p = min(max(need_p, limits.min_prefill), limits.max_prefill)
    d = min(max(need_d, limits.min_decode), limits.max_decode)
    if p < need_p:
        reasons.append(f"prefill: capped at max {limits.max_prefill}")
    if d < need_d:
        reasons.append(f"decode: capped at max {limits.max_decode}")
    if p * limits.prefill_cost + d * limits.decode_cost > limits.budget + 1e-9:
        fitted = _fit_budget(Counts(p, d), needed, limits)
        reasons.append(f"budget {limits.budget:g}: {p}+{d} -> {fitted.prefill}+{fitted.decode}")
        p, d = fitted.prefill, fitted.decode
    if p < current.prefill and since_change[0] < limits.cooldown_s:
        reasons.append(f"prefill: scale-down to {p} waits for the cooldown")
        p = current.prefill
    if d < current.decode and since_change[1] < limits.cooldown_s:
        reasons.append(f"decode: scale-down to {d} waits for the cooldown")
        d = current.decode
    over = p * limits.prefill_cost + d * limits.decode_cost - limits.budget
    if over > 1e-9:  # a role held by its cooldown leaves less budget for the other's rise
        if d > current.decode:
            d = max(current.decode, d - math.ceil(over / limits.decode_cost - 1e-9))
        elif p > current.prefill:
            p = max(current.prefill, p - math.ceil(over / limits.prefill_cost - 1e-9))
        reasons.append(f"budget {limits.budget:g}: a role in cooldown holds its servers")
    return Decision(counts=Counts(p, d), needed=needed, reasons=tuple(reasons))
