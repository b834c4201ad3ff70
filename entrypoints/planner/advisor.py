"""The advisor behind ``pdserve plan``: from profiles (each one server configuration, e.g. one TP
size), a traffic description and SLOs, the cheapest prefill and decode pools that meet the SLOs,
with their predicted TTFT, ITL, goodput and cost, the nearest alternatives, and whether colocated
servers would do it for less.

Disaggregated: every (prefill profile, decode profile) pair, the fewest servers of each role whose
predicted TTFT and ITL (entrypoints/planner/scaling.py's models, at the SLO's quantile) meet the SLOs.
Cost = servers x TP size; goodput = the highest request rate those pools keep within the SLOs
(bisection), so the headroom shows. (The planner's rule adds a utilisation cap on top, for the
swings between intervals; a static recommendation for a stated rate does not need it.)

Colocated: ``n`` servers of one profile each take ``rate / n``; prefills run between decode steps,
so a server spends ``rho = (rate / n) x s`` of its time prefilling; its decode steps stretch by
``1 / (1 - rho)`` and a prompt waits for the prompts ahead (M/M/1 at ``rho``) and for the step in
progress. The smallest ``n`` that meets both SLOs is compared with the best disaggregated cost.
"""

from __future__ import annotations

import math

import msgspec

from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel
from pdserve.entrypoints.planner.profile import Profile
from pdserve.entrypoints.planner.scaling import INF, Load, Slo, predict_itl, predict_ttft, ttft_quantile


class Traffic(msgspec.Struct, frozen=True, kw_only=True):
    rate: float  # requests/s
    input_len: float  # mean prompt tokens
    output_len: float  # mean generated tokens
    prefix_reuse: float = 0.0  # share of prompt tokens served from the prefix cache

    def __post_init__(self):
        if self.rate < 0 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("rate >= 0, input_len >= 1 and output_len >= 1")
        if not 0 <= self.prefix_reuse < 1:
            raise ValueError(f"prefix_reuse must be in [0, 1), got {self.prefix_reuse}")

    def load(self) -> Load:
        # prefill computes only the uncached part; decode holds the whole context
        return Load(self.rate, self.input_len, self.output_len)


class Option(msgspec.Struct, frozen=True, kw_only=True):
    kind: str  # "disaggregated" | "colocated"
    prefill_profile: str  # profile name (file), "" for colocated
    decode_profile: str  # the colocated servers' profile for colocated
    prefill: int
    decode: int  # colocated: the servers
    ttft_s: float  # predicted at the SLO's quantile
    itl_s: float  # predicted at the SLO's quantile of the batch
    goodput_rps: float  # the highest rate kept within the SLOs
    cost: float  # servers x TP size
    server_seconds_per_hour: float
    meets_slo: bool


def _prefill_load(t: Traffic) -> Load:
    return Load(t.rate, max(1.0, t.input_len * (1 - t.prefix_reuse)), t.output_len)


def _pd_meets(pm, dm, t: Traffic, slo: Slo, p: int, d: int) -> tuple[bool, float, float]:
    ttft = predict_ttft(pm, _prefill_load(t), p, quantile=slo.quantile)
    itl, _ = predict_itl(dm, t.load(), d, quantile=slo.quantile)
    return ttft <= slo.ttft_s and itl <= slo.itl_s, ttft, itl


def _colo_predict(pm, dm, t: Traffic, slo: Slo, n: int) -> tuple[float, float]:
    s = pm.ttft(_prefill_load(t).input_len)
    rho = (t.rate / n) * s
    if rho >= 1:
        return INF, INF
    itl_alone, _ = predict_itl(dm, Load(t.rate, t.input_len, t.output_len), n, quantile=slo.quantile)
    if not math.isfinite(itl_alone):
        return INF, INF
    itl = itl_alone / (1 - rho)
    return ttft_quantile(s, rho, slo.quantile) + itl, itl


def _fewest(meets, most: int) -> int:
    """The fewest servers in 1..``most`` for which ``meets`` holds (it holds for all above once it
    does), or ``most`` when none does."""
    if not meets(most):
        return most
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if meets(mid) else (mid + 1, hi)
    return lo


def _goodput(meets, hi: float) -> float:
    """The highest rate (bisection up to ``hi``) at which ``meets(rate)`` holds."""
    if not meets(1e-6):
        return 0.0
    lo = 0.0
    while meets(hi) and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def advise(profiles: dict[str, Profile], traffic: Traffic, slo: Slo, max_servers: int = 64) -> list[Option]:
    """Every option that meets the SLOs within ``max_servers`` per pool, cheapest first (then by
    goodput); options that cannot meet them are listed after, by TTFT."""
    out = []
    models = {name: (PrefillModel(p), DecodeModel(p), p.server.tp_size) for name, p in profiles.items()}
    for pn, (pm, _, ptp) in models.items():
        for dn, (_, dm, dtp) in models.items():
            p = _fewest(lambda n: predict_ttft(pm, _prefill_load(traffic), n, quantile=slo.quantile) <= slo.ttft_s,
                        max_servers)
            d = _fewest(lambda n: predict_itl(dm, traffic.load(), n, quantile=slo.quantile)[0] <= slo.itl_s,
                        max_servers)
            # the fewest, and its neighbours: one more of a role (headroom), one fewer (what it misses)
            for pp, dd in ((p, d), (p + 1, d), (p, d + 1), (p - 1, d), (p, d - 1)):
                if pp < 1 or dd < 1:
                    continue
                ok, ttft, itl = _pd_meets(pm, dm, traffic, slo, pp, dd)
                cost = pp * ptp + dd * dtp
                good = _goodput(lambda r: _pd_meets(pm, dm, msgspec.structs.replace(traffic, rate=r), slo, pp,
                                                    dd)[0], max(traffic.rate, 0.1))
                out.append(Option(kind="disaggregated", prefill_profile=pn, decode_profile=dn, prefill=pp,
                                  decode=dd, ttft_s=ttft, itl_s=itl, goodput_rps=good, cost=cost,
                                  server_seconds_per_hour=cost * 3600, meets_slo=ok))
    for name, (pm, dm, tp) in models.items():
        n = _fewest(lambda k: all(x <= y for x, y in zip(_colo_predict(pm, dm, traffic, slo, k),
                                                         (slo.ttft_s, slo.itl_s))), 2 * max_servers)
        ttft, itl = _colo_predict(pm, dm, traffic, slo, n)
        good = _goodput(lambda r: all(x <= y for x, y in zip(
            _colo_predict(pm, dm, msgspec.structs.replace(traffic, rate=r), slo, n), (slo.ttft_s, slo.itl_s))),
            max(traffic.rate, 0.1))
        out.append(Option(kind="colocated", prefill_profile="", decode_profile=name, prefill=0, decode=n,
                          ttft_s=ttft, itl_s=itl, goodput_rps=good, cost=n * tp, server_seconds_per_hour=n * tp * 3600,
                          meets_slo=ttft <= slo.ttft_s and itl <= slo.itl_s))
    return sorted(out, key=lambda o: (not o.meets_slo, o.cost if o.meets_slo else o.ttft_s, -o.goodput_rps))


def verdict(options: list[Option]) -> str:
    """One sentence: which kind wins for this traffic."""
    best_pd = next((o for o in options if o.kind == "disaggregated" and o.meets_slo), None)
    best_co = next((o for o in options if o.kind == "colocated" and o.meets_slo), None)
    if best_pd is None and best_co is None:
        return "no option meets the SLOs within the limits"
    if best_pd is None:
        return f"only colocated serving meets the SLOs ({best_co.decode} servers)"
    if best_co is not None and best_co.cost < best_pd.cost:
        return (f"colocated serving beats disaggregation for this traffic: {best_co.decode} colocated servers "
                f"(cost {best_co.cost:g}) against {best_pd.prefill} prefill + {best_pd.decode} decode "
                f"(cost {best_pd.cost:g})")
    return (f"disaggregated: {best_pd.prefill} prefill + {best_pd.decode} decode (cost {best_pd.cost:g})"
            + (f"; colocated would need cost {best_co.cost:g}" if best_co else "; colocated cannot meet the SLOs"))
