"""TTFT-SLO-aware admission: a request's TTFT target (``x-pdserve-ttft-slo-ms``, else
``--slo-ttft-ms``) against the estimate from router/tenancy/ttft_estimator.py. A request whose
estimate already misses it is rejected at once (``reject``: a 503 with the reason) or queued
after every other request of its tenant (``deprioritize``), so the requests that can still make
their target are served first. Until the router has measured a prefill rate every request is
admitted as it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.router.errors import RouterError, bad_request

SLO_HEADER = "x-pdserve-ttft-slo-ms"
SLO_MISS_POLICIES = ("reject", "deprioritize")
MAX_SLO_MS = 24 * 3600 * 1000.0


def request_slo_ms(headers: Mapping[str, str], default_ms: float) -> float | None:
    """The request's TTFT target in ms; None: it has none (no header, ``--slo-ttft-ms`` 0)."""
    raw = headers.get(SLO_HEADER)
    if raw is None:
        return default_ms or None
    try:
        value = float(raw.strip())
    except ValueError:
        raise bad_request(f"header {SLO_HEADER} must be a number of milliseconds, got {raw[:40]!r}",
                          SLO_HEADER) from None
    if not 0 < value <= MAX_SLO_MS:  # also refuses nan and inf
        raise bad_request(f"header {SLO_HEADER} must be in (0, {MAX_SLO_MS:.0f}]", SLO_HEADER)
    return value


@dataclass(frozen=True)
class SloDecision:
    estimate_ms: float | None
    miss: bool


def judge(slo_ms: float, estimate_s: float | None) -> SloDecision:
    if estimate_s is None:
        return SloDecision(None, False)
    est = estimate_s * 1000.0
    return SloDecision(est, est > slo_ms)


def slo_unreachable(slo_ms: float, decision: SloDecision) -> RouterError:
    return RouterError(503, f"ttft_slo_unreachable: the estimated time to first token "
                       f"{decision.estimate_ms:.0f} ms exceeds the request's TTFT SLO {slo_ms:.0f} ms",
                       "service_unavailable", SLO_HEADER)
