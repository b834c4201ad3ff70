"""The ``kubernetes`` connector: scales the prefill and decode StatefulSets of deploy/k8s through
the Kubernetes API with the official client (``kubernetes``, imported only when this connector is
chosen), and keeps every router replica's worker list in step.

Pod ``i`` of StatefulSet ``S`` is ``http://S-i.S:30000`` (the headless Service of the same name,
deploy/k8s). Scale-up patches ``spec.replicas`` of the StatefulSet's ``scale`` subresource, then
registers the new pods with each router replica (``POST /workers``; the router probes a pod until
it answers). Scale-down drains first: the pods that will go (the highest ordinals: a StatefulSet
removes those) are drained at every router (``POST /workers/drain``, waiting up to
``drain_timeout``), then the replicas are patched, then the pods are removed from the routers. The
pods' own preStop hook drains them again, harmlessly. The planner needs the RBAC of
deploy/k8s/planner.yaml (get and patch on ``statefulsets/scale``).
"""

from __future__ import annotations

import logging
import threading

from pdserve.entrypoints.planner.connector import Connector
from pdserve.entrypoints.planner.router_api import RouterApi, RouterApiError
from pdserve.entrypoints.planner.scaling import Counts

log = logging.getLogger("pdserve.planner.kubernetes")
ROLES = ("prefill", "decode")
POD_PORT = 30000
BOOTSTRAP_PORT = 8998


class KubernetesConnector(Connector):
    def __init__(self, apps_api, namespace: str, statefulsets: dict[str, str], routers: list[RouterApi],
                 drain_timeout: float = 300.0):
        """``apps_api``: a ``kubernetes.client.AppsV1Api``; ``statefulsets``: role -> name (the
        headless Service has the same name); ``routers``: one RouterApi per router replica."""
        self.api, self.namespace, self.statefulsets = apps_api, namespace, statefulsets
        self.routers, self.drain_timeout = routers, drain_timeout
        self.lock = threading.Lock()
        self.replicas = {role: self._read(role) for role in ROLES}
        self.draining: set[str] = set()
        self.threads: list[threading.Thread] = []

    @classmethod
    def from_config(cls, config, metrics) -> "KubernetesConnector":
        from kubernetes import client
        from kubernetes import config as kube_config

        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        from pdserve.router.worker_hook import router_urls

        urls = router_urls(config.router_pods) or [config.router]
        return cls(client.AppsV1Api(), config.namespace,
                   {"prefill": config.prefill_statefulset, "decode": config.decode_statefulset},
                   [RouterApi(u, config.api_key, config.scrape_timeout, config.admin_api_key) for u in urls], config.drain_timeout)

    def pod_url(self, role: str, ordinal: int) -> str:
        name = self.statefulsets[role]
        return f"http://{name}-{ordinal}.{name}:{POD_PORT}"

    def _read(self, role: str) -> int:
        scale = self.api.read_namespaced_stateful_set_scale(self.statefulsets[role], self.namespace)
        return int(scale.spec.replicas or 0)

    def _patch(self, role: str, replicas: int) -> None:
        self.api.patch_namespaced_stateful_set_scale(self.statefulsets[role], self.namespace,
                                                     {"spec": {"replicas": replicas}})
        with self.lock:
            self.replicas[role] = replicas
        log.info("%s/%s: replicas %d", self.namespace, self.statefulsets[role], replicas)

    def current(self) -> Counts:
        with self.lock:
            return Counts(self.replicas["prefill"], self.replicas["decode"])

    def status(self) -> dict:
        with self.lock:
            return {r: {"replicas": self.replicas[r],
                        "draining": sum(1 for u in self.draining if self.statefulsets[r] + "-" in u)} for r in ROLES}

    def apply(self, target: Counts) -> None:
        for role, want in (("prefill", target.prefill), ("decode", target.decode)):
            have = self.replicas[role]
            if want > have:
                self._patch(role, want)
                for i in range(have, want):
                    self._each_router(lambda r, u=self.pod_url(role, i): r.add(
                        u, role, BOOTSTRAP_PORT if role == "prefill" else None))
            elif want < have:
                urls = [self.pod_url(role, i) for i in range(want, have)]
                if any(u in self.draining for u in urls):
                    continue  # a scale-down of this role is under way
                with self.lock:
                    self.draining.update(urls)
                t = threading.Thread(target=self._scale_down, args=(role, want, urls), daemon=True)
                self.threads.append(t)
                t.start()

    def _scale_down(self, role: str, want: int, urls: list[str]) -> None:
        """Scale-down always drains: the pods that will go take no new requests and finish theirs."""
        for u in urls:
            self._each_router(lambda r, u=u: r.drain(u, self.drain_timeout))
        try:
            self._patch(role, want)
        finally:
            for u in urls:
                self._each_router(lambda r, u=u: r.remove(u))
            with self.lock:
                self.draining.difference_update(urls)

    def _each_router(self, call) -> None:
        for r in self.routers:
            try:
                call(r)
            except RouterApiError as e:
                log.warning("router %s: %s", r.base, e)

    def poll(self) -> None:
        """Follow changes made by others (kubectl scale): the API's replicas are the truth."""
        with self.lock:
            busy = bool(self.draining)
        if not busy:
            for role in ROLES:
                n = self._read(role)
                with self.lock:
                    self.replicas[role] = n

    def close(self) -> None:
        for t in self.threads:
            t.join()
