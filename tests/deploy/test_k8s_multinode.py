"""The LeaderWorkerSet variant (deploy/k8s-multinode): servers whose TP group spans pods.

A LeaderWorkerSet is a custom resource, outside the Kubernetes schema, so its pod templates are
validated as core ``PodTemplate``s (strict, offline), its own fields against the LWS v1 API's
names, and every pod's args parse with pdserve's CLI as LWS fills them in: node i of a group
gets ``--node-rank i`` and registers with the bootstrap server on the leader."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from test_k8s_manifests import K8S_VERSION, KEY_FILE, find, offline  # noqa: F401 - offline is a fixture

LWS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s-multinode"
# leaderworkerset.x-k8s.io/v1 field names (sigs.k8s.io/lws api/leaderworkerset/v1)
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {"size", "leaderTemplate", "workerTemplate", "restartPolicy", "subGroupPolicy"}
RESTART_POLICIES = {"RecreateGroupOnPodRestart", "None"}
STARTUP_POLICIES = {"LeaderCreated", "LeaderReady"}


def lws_docs() -> list[dict]:
    return [d for p in sorted(LWS_DIR.glob("*-lws.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def templates(doc: dict) -> dict[str, dict]:
    t = doc["spec"]["leaderWorkerTemplate"]
    return {"leader": t["leaderTemplate"], "worker": t["workerTemplate"]}


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_lws_fields_and_pod_templates_validate(offline):  # noqa: F811
    docs = lws_docs()
    assert {d["metadata"]["name"] for d in docs} == {"pdserve-prefill", "pdserve-decode"}
    for doc in docs:
        assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and doc["kind"] == "LeaderWorkerSet"
        assert set(doc["spec"]) <= LWS_SPEC and set(doc["spec"]["leaderWorkerTemplate"]) <= LWS_TEMPLATE
        t = doc["spec"]["leaderWorkerTemplate"]
        assert t["restartPolicy"] in RESTART_POLICIES and doc["spec"]["startupPolicy"] in STARTUP_POLICIES
        assert isinstance(t["size"], int) and t["size"] >= 2
        for role, tmpl in templates(doc).items():
            pod = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"{doc['metadata']['name']}-{role}"}, "template": tmpl}
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_a_broken_pod_template_fails_validation(offline):  # noqa: F811
    doc = lws_docs()[0]
    tmpl = templates(doc)["worker"]
    tmpl["spec"]["containers"][0]["volumeMount"] = tmpl["spec"]["containers"][0].pop("volumeMounts")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                                      "template": tmpl}, K8S_VERSION, strict=True)


def test_every_node_parses_and_registers_with_the_leader(tmp_path):
    from pdserve.entrypoints.flags import parse_serve_args

    key = tmp_path / "key"
    key.write_text("k" * 44)  # the Secret is generated at deploy time (kustomization.yaml's secretGenerator)
    for doc in lws_docs():
        name = doc["metadata"]["name"]
        size = doc["spec"]["leaderWorkerTemplate"]["size"]
        leader = f"{name}-0.{name}.pdserve"
        for i in range(size):
            tmpl = templates(doc)["leader" if i == 0 else "worker"]
            (c,) = tmpl["spec"]["containers"]
            env = {"POD_IP": f"10.0.0.{7 + i}", "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(i),
                   "LWS_LEADER_ADDRESS": leader}
            assert c["args"][0] == "serve" and f"--disaggregation-auth-key-file={KEY_FILE}" in c["args"]
            config = parse_serve_args([a.replace(KEY_FILE, str(key)) for a in expand(c["args"][1:], env)])
            assert (config.nnodes, config.node_rank, config.host) == (size, i, f"10.0.0.{7 + i}")
            assert config.tp_size > 1 and config.tp_size % size == 0
            assert config.dist_init_addr.startswith(leader + ":")
            if config.disaggregation_mode == "prefill":
                assert config.bootstrap_host == leader  # every node's ranks register on the leader
            mounts = {m["name"] for m in c["volumeMounts"]}
            assert "kv-auth" in mounts
            assert c["resources"]["requests"]["cpu"] == c["resources"]["limits"]["cpu"]


def test_leaders_take_the_statefulsets_place_behind_the_base_services():
    kust = yaml.safe_load((LWS_DIR / "kustomization.yaml").read_text())
    assert "../k8s" in kust["resources"]
    assert sorted(r for r in kust["resources"] if r != "../k8s") == sorted(
        p.name for p in LWS_DIR.glob("*-lws.yaml"))
    deleted = {yaml.safe_load(p["patch"])["metadata"]["name"] for p in kust["patches"]
               if "$patch: delete" in p["patch"]}
    for doc in lws_docs():
        name = doc["metadata"]["name"]
        sts = find("StatefulSet", name)
        assert name in deleted and doc["spec"]["replicas"] == sts["spec"]["replicas"]  # the router's URLs
        svc = find("Service", sts["spec"]["serviceName"])
        selector = svc["spec"]["selector"]
        t = templates(doc)
        assert all(t["leader"]["metadata"]["labels"].get(k) == v for k, v in selector.items())
        assert not all(t["worker"]["metadata"]["labels"].get(k) == v for k, v in selector.items())
        (c,) = t["leader"]["spec"]["containers"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        hook = c["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert f"{name}:30000" in hook
        wait = float(re.search(r"--wait-secs (\d+)", hook).group(1))
        assert t["leader"]["spec"]["terminationGracePeriodSeconds"] >= wait + 20
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        dist_port = int(next(a for a in c["args"] if a.startswith("--dist-init-addr")).rsplit(":", 1)[1])
        assert ports["dist-init"] == dist_port
        if name == "pdserve-prefill":
            assert ports["bootstrap"] == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "bootstrap")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_the_variant(tmp_path):
    deploy = tmp_path / "deploy"
    shutil.copytree(LWS_DIR.parent, deploy)
    for name in ("kv-auth.key", "store.key"):  # generated at deploy time (deploy/k8s/kustomization.yaml)
        (deploy / "k8s" / name).write_text("k" * 44)
    out = subprocess.run(["kubectl", "kustomize", str(deploy / LWS_DIR.name)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    kinds = [(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace"))
             for d in yaml.safe_load_all(out.stdout) if d]
    assert ("LeaderWorkerSet", "pdserve-prefill", "pdserve") in kinds
    assert not [k for k in kinds if k[0] == "StatefulSet"]
