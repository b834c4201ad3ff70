"""Connectors: how the planner's counts become servers. A small base, a registry whose names are
the CLI's choices, and each implementation imported only when chosen (``kubernetes`` needs the
official client, ``local`` the launcher).

- ``virtual``: records the decisions only (the simulator reads them; a dry run logs them);
- ``local``: the servers of a ``pdserve launch`` cluster (entrypoints/planner/local_connector.py);
- ``kubernetes``: the StatefulSets of deploy/k8s (entrypoints/planner/k8s_connector.py).
"""

from __future__ import annotations

import importlib

from pdserve.entrypoints.planner.scaling import Counts

CONNECTORS = {
    "virtual": "pdserve.entrypoints.planner.connector:VirtualConnector",
    "local": "pdserve.entrypoints.planner.local_connector:LocalConnector",
    "kubernetes": "pdserve.entrypoints.planner.k8s_connector:KubernetesConnector",
}


class Connector:
    @classmethod
    def from_config(cls, config, metrics) -> "Connector":
        """The connector for a ``PlannerConfig``; ``metrics`` (PlannerMetrics) counts its faults."""
        raise NotImplementedError

    def current(self) -> Counts:
        """The servers that count as capacity now: running or starting, not draining, not failed."""
        raise NotImplementedError

    def apply(self, target: Counts) -> None:
        """Move toward ``target``: start servers, or drain and then stop them. Returns at once;
        the work continues in the background (``poll`` advances it)."""
        raise NotImplementedError

    def poll(self) -> None:
        """Advance background work (servers becoming ready, drains finishing, retries)."""

    def status(self) -> dict:
        """Counts by state for the planner's /metrics: {"prefill": {"ready": n, ...}, "decode": ...}."""
        c = self.current()
        return {"prefill": {"ready": c.prefill}, "decode": {"ready": c.decode}}

    def close(self) -> None:
        """Stop background work; the servers are left as they are."""


class VirtualConnector(Connector):
    """Records every target with its time; ``current`` is the last target (or the initial one)."""

    def __init__(self, initial: Counts):
        self.target = initial
        self.history: list[Counts] = []

    @classmethod
    def from_config(cls, config, metrics) -> "VirtualConnector":
        """Starts from the router's workers in rotation (the minima when it does not answer)."""
        from pdserve.entrypoints.planner.router_api import RouterApi

        try:
            listing = RouterApi(config.router, config.api_key, config.scrape_timeout, config.admin_api_key).workers()
            n = {r: sum(1 for w in listing.get(r) or [] if not w.get("draining")) for r in ("prefill", "decode")}
            return cls(Counts(n["prefill"], n["decode"]))
        except OSError:
            return cls(Counts(config.min_prefill, config.min_decode))

    def current(self) -> Counts:
        return self.target

    def apply(self, target: Counts) -> None:
        self.history.append(target)
        self.target = target


def connector_class(name: str) -> type[Connector]:
    if name not in CONNECTORS:
        raise ValueError(f"connector must be one of {list(CONNECTORS)}, got {name!r}")
    module, attr = CONNECTORS[name].split(":")
    return getattr(importlib.import_module(module), attr)
