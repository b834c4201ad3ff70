"""The planner's own ``/metrics``: each decision and its inputs, the servers by state, and the
faults (failed or nonsense scrapes, servers that failed to start)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.engine.prometheus_text import exposition
from pdserve.entrypoints.planner.sla_planner import Step

ROLES = ("prefill", "decode")


class PlannerMetrics:
    def __init__(self):
        self.registry = reg = CollectorRegistry()
        self.target = Gauge("pdserve_planner_target_servers", "Servers the last decision asked for.", ("role",),
                            registry=reg)
        self.needed = Gauge("pdserve_planner_needed_servers",
                            "Servers the SLOs need at the predicted load, before limits, budget and cooldown.",
                            ("role",), registry=reg)
        self.servers = Gauge("pdserve_planner_servers", "Servers by state as the connector sees them.",
                             ("role", "state"), registry=reg)
        self.predicted = Gauge("pdserve_planner_predicted_load",
                               "The next interval's predicted load: rate (req/s), input_len, output_len (tokens).",
                               ("quantity",), registry=reg)
        self.observed = Gauge("pdserve_planner_observed",
                              "The last interval as read from the router and workers: rate, input_len, "
                              "output_len, ttft_s, itl_s (absent values are not updated).", ("quantity",),
                              registry=reg)
        self.correction = Gauge("pdserve_planner_correction_factor",
                                "Observed / profiled latency: prefill (TTFT), decode (ITL).", ("role",), registry=reg)
        self.decisions = Counter("pdserve_planner_decisions", "Decisions taken (held ones included).", registry=reg)
        self.held = Counter("pdserve_planner_held_decisions",
                            "Intervals whose scrape failed or made no sense: the last decision stood.", ("reason",),
                            registry=reg)
        self.scale_events = Counter("pdserve_planner_scale_events", "Changes of the target, by role and direction.",
                                    ("role", "direction"), registry=reg)
        self.start_failures = Counter("pdserve_planner_server_start_failures",
                                      "Servers that failed to start (retried with backoff).", ("role",), registry=reg)

    def record(self, step: Step, previous_target: tuple[int, int] | None) -> None:
        self.decisions.inc()
        if step.held:
            self.held.labels("scrape_failed" if step.observation is None else "nonsense").inc()
            return
        counts = step.decision.counts
        for role, n, need, corr in (("prefill", counts.prefill, step.decision.needed.prefill, step.corrections[0]),
                                    ("decode", counts.decode, step.decision.needed.decode, step.corrections[1])):
            self.target.labels(role).set(n)
            self.needed.labels(role).set(need)
            self.correction.labels(role).set(corr)
        if previous_target is not None:
            for role, old, new in (("prefill", previous_target[0], counts.prefill),
                                   ("decode", previous_target[1], counts.decode)):
                if new != old:
                    self.scale_events.labels(role, "up" if new > old else "down").inc()
        if step.predicted is not None:
            for q in ("rate", "input_len", "output_len"):
                self.predicted.labels(q).set(getattr(step.predicted, q))
        obs = step.observation
        if obs is not None:
            for q in ("rate", "input_len", "output_len", "ttft_s", "itl_s"):
                v = getattr(obs, q)
                if v is not None:
                    self.observed.labels(q).set(v)

    def set_servers(self, status: dict) -> None:
        for role, states in status.items():
            for state, n in states.items():
                self.servers.labels(role, state).set(n)

    def render(self) -> bytes:
        return exposition(self.registry)
