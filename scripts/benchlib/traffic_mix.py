"""Shared-fleet workloads: which tenant sends each request and at which priority, and the figures by group.

``--tenants N`` spreads the requests over tenants ``tenant-0`` .. ``tenant-{N-1}`` (in proportion to
``--tenant-weights``, equal by default), named by a header (``--tenant-header-name``, the router's
``--tenant-header``). ``--priority-mix P1:F1,P2:F2`` gives a fraction ``F`` of the requests priority
``P``, sent both as the router's header and as the body's ``priority`` (the servers' field). Counts
are exact (largest remainders of the shares), then shuffled with the run's seed, so a run and its
baseline send the same requests with the same tags. Pure logic: no I/O.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from .metrics import RequestOutput, calculate_metrics

PRIORITY_HEADER = "x-pdserve-priority"  # router/request_priority.py's name
DEFAULT_TENANT_HEADER = "x-tenant"
GROUP_KEYS = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
              "goodput", "slo_attainment")


@dataclasses.dataclass(frozen=True)
class RequestTag:
    """Who sends one request and how urgent it is (None: not set, nothing is sent)."""

    tenant: str | None = None
    priority: int | None = None

    def headers(self, tenant_header: str, priority_header: bool = True) -> dict[str, str]:
        """The tenant's header, and the priority's unless ``priority_header`` is off."""
        out = {}
        if self.tenant is not None:
            out[tenant_header] = self.tenant
        if self.priority is not None and priority_header:
            out[PRIORITY_HEADER] = str(self.priority)
        return out

    def body(self) -> dict:
        return {} if self.priority is None else {"priority": self.priority}


def parse_priority_mix(text: str) -> list[tuple[int, float]]:
    """``"10:0.2,0:0.8"`` -> ``[(10, 0.2), (0, 0.8)]``; ValueError naming the bad part. Fractions
    are > 0 and sum to 1; a priority appears once."""
    out: list[tuple[int, float]] = []
    for part in text.split(","):
        prio, sep, frac = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            p, f = int(prio), float(frac)
        except ValueError:
            raise ValueError(f"--priority-mix: {part.strip()!r} is not PRIORITY:FRACTION") from None
        if not f > 0:
            raise ValueError(f"--priority-mix: the fraction of priority {p} must be > 0, got {frac}")
        if any(p == q for q, _ in out):
            raise ValueError(f"--priority-mix: priority {p} is given twice")
        out.append((p, f))
    if abs(sum(f for _, f in out) - 1.0) > 1e-6:
        raise ValueError(f"--priority-mix: the fractions must sum to 1, got {sum(f for _, f in out):g}")
    return out


def parse_tenant_weights(text: str, tenants: int) -> list[float]:
    """``"4,1,1"`` -> one weight > 0 per tenant (exactly ``tenants`` of them)."""
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"--tenant-weights: not a list of numbers: {text!r}") from None
    if len(weights) != tenants:
        raise ValueError(f"--tenant-weights: {len(weights)} weight(s) for --tenants {tenants}")
    if not all(w > 0 for w in weights):
        raise ValueError(f"--tenant-weights: every weight must be > 0, got {text!r}")
    return weights


def tenant_names(tenants: int) -> list[str]:
    return [f"tenant-{i}" for i in range(tenants)]


def tenant_index(name: str) -> int:
    """``tenant-3`` -> 3 (the order tenants are listed in)."""
    return int(name.rpartition("-")[2])


def apportion(n: int, shares: Sequence[float]) -> list[int]:
    """``n`` split in proportion to ``shares``: the floors, then one more to the largest remainders
    (the earlier share on a tie); the counts sum to ``n``."""
    total = sum(shares)
    exact = [n * s / total for s in shares]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _spread(n: int, values: list, shares: Sequence[float], rng: random.Random) -> list:
    out = [v for v, k in zip(values, apportion(n, shares)) for _ in range(k)]
    rng.shuffle(out)
    return out


def assign_tags(n: int, tenants: int = 0, tenant_weights: Sequence[float] | None = None,
                priority_mix: Sequence[tuple[int, float]] | None = None, seed: int = 0) -> list[RequestTag]:
    """One tag per request: tenants by weight and priorities by fraction, each an exact count, in a
    seeded random order (independent of each other). ``tenants`` 0 and no mix: untagged requests."""
    rng = random.Random(seed)
    names: list = [None] * n
    prios: list = [None] * n
    if tenants:
        names = _spread(n, tenant_names(tenants), tenant_weights or [1.0] * tenants, rng)
    if priority_mix:
        prios = _spread(n, [p for p, _ in priority_mix], [f for _, f in priority_mix], rng)
    return [RequestTag(t, p) for t, p in zip(names, prios)]


def group_metrics(outputs: Sequence[RequestOutput], tags: Sequence[RequestTag], duration: float,
                  slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict:
    """``{"by_tenant": {name: figures}, "by_priority": {str(priority): figures}}``, each group's
    TTFT, TPOT and goodput (``GROUP_KEYS``) over the run's whole duration; a dimension not used
    is absent."""
    out: dict = {}
    for key, attr in (("by_tenant", "tenant"), ("by_priority", "priority")):
        groups: dict = {}
        for o, t in zip(outputs, tags):
            value = getattr(t, attr)
            if value is not None:
                groups.setdefault(value, []).append(o)
        if not groups:
            continue
        # tenants in their order of definition; priorities from the highest value down
        order = sorted(groups, key=tenant_index) if attr == "tenant" else sorted(groups, reverse=True)
        out[key] = {}
        for g in order:
            m = calculate_metrics(groups[g], duration, slo_ttft_ms, slo_tpot_ms)
            out[key][str(g)] = {k: m[k] for k in GROUP_KEYS}
    return out


def format_groups(groups: dict) -> str:
    """The per-tenant and per-priority table printed after the summary."""

    def ms(v) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    lines = []
    for key, title in (("by_tenant", "tenant"), ("by_priority", "priority")):
        if key not in groups:
            continue
        lines.append(f"{title:<12}{'done':>6}{'fail':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
                     f"{'goodput':>9}")
        for name, g in groups[key].items():
            lines.append(f"{name:<12}{g['completed']:>6}{g['failed']:>6}{ms(g['median_ttft_ms']):>10}"
                         f"{ms(g['p99_ttft_ms']):>10}{ms(g['median_tpot_ms']):>10}{g['goodput']:>9.2f}")
    return "\n".join(lines)
