"""The kubernetes connector through the official client against a local API double: the
StatefulSets' scale subresource at the names and namespace of deploy/k8s, each patch checked
against the Kubernetes schema (kubernetes-validate, strict); the pods registered, drained and
removed at a real router; and the planner's manifest (RBAC and args) in deploy/k8s."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from aiohttp import web

from pdserve.entrypoints.planner.k8s_connector import KubernetesConnector
from pdserve.entrypoints.planner.router_api import RouterApi
from pdserve.entrypoints.planner.scaling import Counts
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.server import start_router

kubernetes = pytest.importorskip("kubernetes")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.30.0"
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


def _docs() -> list[dict]:
    return [d for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]


def _namespace() -> str:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]


def pod(role: str, i: int) -> str:
    return f"http://pdserve-{role}-{i}.pdserve-{role}:30000"


class ApiDouble:
    """The scale subresource of the manifests' StatefulSets, as the API server answers it."""

    def __init__(self):
        self.namespace = _namespace()
        self.replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in _docs() if d["kind"] == "StatefulSet"}
        self.patches: list[tuple[str, str, dict]] = []
        self.refused: list[str] = []

    def _scale(self, name: str) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": {"replicas": self.replicas[name]}, "status": {"replicas": self.replicas[name]}}

    async def handle(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        if ns != self.namespace or name not in self.replicas:
            self.refused.append(f"{request.method} {ns}/{name}")
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                                      "reason": "NotFound", "message": f"statefulsets.apps {name!r} not found"},
                                     status=404)
        if request.method == "PATCH":
            ctype = request.headers.get("Content-Type", "")
            body = json.loads(await request.read())
            if ctype not in PATCH_TYPES:
                self.refused.append(f"content type {ctype}")
                return web.json_response({"kind": "Status", "code": 415}, status=415)
            # the patch merged into the Scale must be a valid autoscaling/v1 Scale (strict: no unknown field)
            merged = {**self._scale(name), **body, "spec": {**self._scale(name)["spec"], **body.get("spec", {})}}
            kubernetes_validate.validate(merged, K8S_VERSION, strict=True)
            self.patches.append((ns, name, body))
            self.replicas[name] = merged["spec"]["replicas"]
        return web.json_response(self._scale(name))


async def test_patches_follow_the_manifests_and_the_schema():
    double = ApiDouble()
    app = web.Application()
    path = "/apis/apps/v1/namespaces/{ns}/statefulsets/{name}/scale"
    app.router.add_route("GET", path, double.handle)
    app.router.add_route("PATCH", path, double.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    api_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    # the router as router.yaml starts it: pods 0 and 1 of each StatefulSet
    router, router_runner, port = await start_router(RouterConfig(
        prefill=tuple(WorkerSpec(pod("prefill", i), "prefill", 8998) for i in range(2)),
        decode=tuple(WorkerSpec(pod("decode", i), "decode") for i in range(2)), host="127.0.0.1", port=0,
                                                                  health_check_interval_secs=3600.0,
                                                                  health_check_timeout_secs=0.2))
    try:
        cfg = kubernetes.client.Configuration()
        cfg.host = api_url
        apps = kubernetes.client.AppsV1Api(kubernetes.client.ApiClient(cfg))
        conn = await asyncio.to_thread(
            KubernetesConnector, apps, double.namespace, {"prefill": "pdserve-prefill", "decode": "pdserve-decode"},
            [RouterApi(f"http://127.0.0.1:{port}")], 0.5)
        assert conn.current() == Counts(2, 2)  # the manifests' replicas
        await asyncio.to_thread(conn.apply, Counts(2, 4))
        assert double.patches == [(double.namespace, "pdserve-decode", {"spec": {"replicas": 4}})]
        assert [w.url for w in router.registry.workers("decode")] == [pod("decode", i) for i in range(4)]
        # scale-down drains the pods that go (the highest ordinals) before the patch, then removes them
        await asyncio.to_thread(conn.apply, Counts(1, 3))
        await asyncio.to_thread(conn.close)
        assert sorted(double.patches[1:]) == [(double.namespace, "pdserve-decode", {"spec": {"replicas": 3}}),
                                              (double.namespace, "pdserve-prefill", {"spec": {"replicas": 1}})]
        assert [w.url for w in router.registry.workers("decode")] == [pod("decode", i) for i in range(3)]
        assert [w.url for w in router.registry.workers("prefill")] == [pod("prefill", 0)]
        assert conn.current() == Counts(1, 3) and double.refused == []
        # a name the manifests do not have is refused by the double (and raises in the client)
        bad = KubernetesConnector.__new__(KubernetesConnector)
        bad.api, bad.namespace, bad.statefulsets = apps, double.namespace, {"decode": "decode"}
        with pytest.raises(kubernetes.client.ApiException):
            await asyncio.to_thread(bad._read, "decode")
    finally:
        await router_runner.cleanup()
        await runner.cleanup()


def test_planner_manifest_rbac_and_args():
    from pdserve.entrypoints.flags import build_serve_parser
    from pdserve.entrypoints.planner.cli import parse_planner_args

    docs = {(d["kind"], d["metadata"]["name"]): d for d in _docs()}
    role = docs[("Role", "pdserve-planner")]
    (rule,) = role["rules"]
    sts = {n for k, n in docs if k == "StatefulSet"}
    assert rule["resources"] == ["statefulsets/scale"] and set(rule["resourceNames"]) == sts
    assert set(rule["verbs"]) == {"get", "patch"}  # what the connector calls, nothing more
    binding = docs[("RoleBinding", "pdserve-planner")]
    assert binding["roleRef"]["name"] == "pdserve-planner"
    deployment = docs[("Deployment", "pdserve-planner")]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == binding["subjects"][0]["name"] == "pdserve-planner"
    (c,) = spec["containers"]
    assert c["args"][0] == "planner"
    config = parse_planner_args(c["args"][1:], build_serve_parser)
    assert config.connector == "kubernetes" and config.namespace == _namespace()
    assert {config.prefill_statefulset, config.decode_statefulset} == sts
    decode = docs[("StatefulSet", "pdserve-decode")]
    assert config.drain_timeout <= decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert "planner.yaml" in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
