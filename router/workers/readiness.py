"""Readiness: can the router serve, what is missing when it cannot, and the gate requests wait at.

The router serves when at least one healthy prefill endpoint and one healthy
decode endpoint exist, or one healthy colocated worker (draining workers do not count): ``readiness()`` says so,
with the counts per role, for ``GET /readiness``. ``PairGate`` wakes the
requests that arrived while no pair existed (``--request-queue-timeout-secs``),
from the registry's change events rather than by polling.
"""

from __future__ import annotations

import asyncio

from pdserve.router.workers.worker_registry import ROLES, WorkerRegistry


def readiness(registry: WorkerRegistry) -> tuple[bool, dict]:
    """(ready, body): ``missing`` lists the roles with no healthy endpoint."""
    roles = {}
    missing = []
    for role in ROLES:
        workers = registry.workers(role)
        healthy = len(registry.healthy_endpoints(role))
        roles[role] = {"registered": len(workers), "healthy_endpoints": healthy,
                       "draining": sum(w.draining for w in workers)}
        if not healthy and not (role == "prefill" and registry.serves_alone):
            missing.append(role)
    return not missing, {"missing": missing, "workers": roles}


def describe_missing(body: dict) -> str:
    """One line for an operator: 'no healthy decode worker (2 registered, 1 draining)'."""
    parts = []
    for role in body["missing"]:
        counts = body["workers"][role]
        parts.append(f"no healthy {role} worker ({counts['registered']} registered, "
                     f"{counts['draining']} draining)")
    return "; ".join(parts)


class PairGate:
    """Open while a healthy prefill+decode pair (or a colocated worker) exists; ``wait`` blocks
    until it opens."""

    def __init__(self, registry: WorkerRegistry):
        self.registry = registry
        self._open = asyncio.Event()
        registry.on_change(self._update)
        self._update()

    def _update(self) -> None:
        if all(self.registry.healthy_endpoints(role) for role in ROLES) or self.registry.serves_alone:
            self._open.set()
        else:
            self._open.clear()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def wait(self, timeout: float) -> bool:
        """True once a pair exists, False when ``timeout`` seconds passed without one."""
        if self._open.is_set():
            return True
        try:
            await asyncio.wait_for(self._open.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
