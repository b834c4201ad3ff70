"""The Kubernetes manifests (deploy/k8s): every document validates against the Kubernetes schema
(kubernetes-validate's own offline copy, strict: an unknown or misspelled field fails), the
kustomization lists every manifest, the containers' args parse with pdserve's own CLIs, the
router's worker URLs name the pods the StatefulSets make, each pod's grace period covers its
drain, and the pods are locked down: only the router public (NetworkPolicies), seccomp, no
capabilities, a read-only root, no service-account token but the planner's, probed store pods,
and keys generated into Secrets mounted as files, never committed."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# a version whose schema kubernetes-validate ships (>= 1.30 does); the manifests use no field newer
K8S_VERSION = "1.30.0"


def manifests() -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"}


def resources() -> list[dict]:
    return [doc for docs in manifests().values() for doc in docs]


def find(kind: str, name: str) -> dict:
    (doc,) = [d for d in resources() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(doc: dict) -> dict:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture
def offline(monkeypatch):
    """No network while validating: CI reaches package registries only."""

    def refuse(*args, **kwargs):
        raise OSError("network access during schema validation")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_every_manifest_validates_against_the_kubernetes_schema(offline):
    docs = resources()
    assert {d["kind"] for d in docs} >= {"Namespace", "NetworkPolicy", "Service", "StatefulSet", "Deployment"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("breakage", ["misspelled field", "wrong type", "unknown probe field"])
def test_a_broken_manifest_fails_validation(offline, breakage):
    doc = find("StatefulSet", "pdserve-decode")
    spec = doc["spec"]["template"]["spec"]
    if breakage == "misspelled field":
        spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    elif breakage == "wrong type":
        doc["spec"]["replicas"] = "two"
    else:
        container(doc)["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    assert sorted(kust["resources"]) == sorted(manifests())
    images = {i["name"] for i in kust["images"]}
    for doc in resources():
        if doc["kind"] in ("StatefulSet", "Deployment"):
            assert container(doc)["image"] in images


KEY_FILE = "/etc/pdserve/kv-auth/key"  # where the pods mount the Secret


def _expand(args: list[str], key_file: str = KEY_FILE) -> list[str]:
    """$(POD_IP) as the kubelet would, and the Secret's mount path as a local file."""
    return [re.sub(r"\$\((\w+)\)", "10.0.0.7", a).replace(KEY_FILE, key_file) for a in args]


def test_container_args_parse_with_pdserve_clis(tmp_path):
    from pdserve.entrypoints.flags import parse_serve_args
    from pdserve.router.cli import build_parser, config_from_args

    key = tmp_path / "key"
    key.write_text("k" * 44)  # as the documented command makes it (32 random bytes, base64)
    for name, mode in (("pdserve-prefill", "prefill"), ("pdserve-decode", "decode")):
        args = container(find("StatefulSet", name))["args"]
        assert args[0] == "serve" and f"--disaggregation-auth-key-file={KEY_FILE}" in args
        config = parse_serve_args(_expand(args[1:], str(key)))
        assert config.disaggregation_mode == mode and config.host == "10.0.0.7"
        assert config.kv_transfer.auth_key_file == str(key) and config.tp_size == 1
    args = container(find("Deployment", "pdserve-router"))["args"]
    assert args[0] == "router"
    config_from_args(build_parser().parse_args(args[1:]))


def test_router_names_every_worker_pod_and_probes_readiness():
    from pdserve.router.cli import build_parser, config_from_args

    router = find("Deployment", "pdserve-router")
    config = config_from_args(build_parser().parse_args(container(router)["args"][1:]))
    for role, specs in (("prefill", config.prefill), ("decode", config.decode)):
        sts = find("StatefulSet", f"pdserve-{role}")
        svc = find("Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
        want = [f"http://pdserve-{role}-{i}.{svc['metadata']['name']}:{port}"
                for i in range(sts["spec"]["replicas"])]
        assert [s.url for s in specs] == want
        if role == "prefill":
            bootstrap = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "bootstrap")
            assert {s.bootstrap_port for s in specs} == {bootstrap}
    c = container(router)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["livenessProbe"]["httpGet"]["path"] == "/liveness"


def _flag(args: list[str], name: str) -> float:
    for a in args:
        if a.startswith(name + "="):
            return float(a.split("=", 1)[1])
    raise AssertionError(f"no {name} in {args}")


def test_grace_periods_cover_the_drains():
    router = find("Deployment", "pdserve-router")
    c = container(router)
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])  # sleep N
    drain = _flag(c["args"], "--graceful-shutdown-timeout")
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
    for name in ("pdserve-prefill", "pdserve-decode"):
        sts = find("StatefulSet", name)
        c = container(sts)
        hook = c["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert "pdserve.router.worker_hook drain" in hook and f"{name}:30000" in hook
        assert "worker_hook undrain" in c["lifecycle"]["postStart"]["exec"]["command"][-1]
        wait = float(re.search(r"--wait-secs (\d+)", hook).group(1))
        assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= wait + 20
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["kv-auth"]["readOnly"]
        assert c["resources"]["requests"]["cpu"] == c["resources"]["limits"]["cpu"]
        assert _flag(c["args"], "--num-threads") == float(c["resources"]["requests"]["cpu"])
    # the decode drain (long streams) fits in the router's
    decode_hook = container(find("StatefulSet", "pdserve-decode"))["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert float(re.search(r"--wait-secs (\d+)", decode_hook).group(1)) <= drain


def test_dockerfile_runs_setup_sh_on_python_slim():
    text = (K8S.parents[1] / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim-bookworm$", text, re.M)
    assert "bash scripts/setup.sh" in text and 'ENTRYPOINT ["pdserve"]' in text
    ignored = (K8S.parents[1] / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def workloads() -> list[dict]:
    return [d for d in resources() if d["kind"] in ("StatefulSet", "Deployment")]


def test_pods_are_locked_down():
    for doc in workloads():
        name, pod = doc["metadata"]["name"], doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"], name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        if name == "pdserve-planner":  # it scales the StatefulSets through the API
            assert pod["serviceAccountName"] == "pdserve-planner" and "automountServiceAccountToken" not in pod
        else:
            assert pod["automountServiceAccountToken"] is False, name
        c = container(doc)
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
        tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert len(tmp) == 1 and "emptyDir" in vols[tmp[0]["name"]], name  # where it writes


def test_store_pods_are_probed():
    for name in ("pdserve-mooncake", "pdserve-mooncake-store"):
        c = container(find("Deployment", name))
        assert c["readinessProbe"]["tcpSocket"] and c["livenessProbe"]["tcpSocket"], name


def _components(selector: dict) -> set[str]:
    if "matchLabels" in selector:
        return {selector["matchLabels"]["app.kubernetes.io/component"]}
    (expr,) = selector["matchExpressions"]
    assert expr["key"] == "app.kubernetes.io/component" and expr["operator"] == "In"
    return set(expr["values"])


def test_only_the_router_is_public():
    policies = {d["metadata"]["name"]: d["spec"] for d in resources() if d["kind"] == "NetworkPolicy"}
    deny = [p for p in policies.values() if p["podSelector"] == {} and "ingress" not in p]
    assert deny and deny[0]["policyTypes"] == ["Ingress"]  # everything closed by default
    pods = {doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for doc in workloads()}
    opened: dict[str, list[dict]] = {}
    for p in policies.values():
        if p["podSelector"]:
            for comp in _components(p["podSelector"]):
                opened.setdefault(comp, []).extend(p.get("ingress", []))
    public = {comp for comp, rules in opened.items() for r in rules if "from" not in r}
    assert public == {"router"}
    assert [p["port"] for r in opened["router"] for p in r["ports"]] == [30000]
    pool, store = {"prefill", "decode"}, {"kv-store-master", "kv-store-memory"}
    assert pool | store | {"router", "planner"} == pods
    for comp in store:  # the store: pool and store pods only
        assert set().union(*(_components(f["podSelector"]) for r in opened[comp] for f in r["from"])) <= pool | store
    for comp in pool:  # any port only from pool and store pods; routers and the planner: HTTP only
        for r in opened[comp]:
            sources = set().union(*(_components(f["podSelector"]) for f in r["from"]))
            if not sources <= pool | store:
                assert [p["port"] for p in r["ports"]] == [30000], r


def test_keys_are_generated_secrets_mounted_as_files():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert not [d for d in resources() if d["kind"] == "Secret"]  # no key committed
    (gen,) = kust["secretGenerator"]
    files = dict(f.split("=") for f in gen["files"])
    assert gen["name"] == "pdserve-kv-auth" and set(files) == {"key", "store-key"}
    ignored = (K8S / ".gitignore").read_text().split()
    assert all(f in ignored for f in files.values())
    for path in K8S.rglob("*"):
        if path.is_file():
            assert "replace-me-with-a-random-secret" not in path.read_text(), path
    for name in ("pdserve-prefill", "pdserve-decode"):
        sts = find("StatefulSet", name)
        c, pod = container(sts), sts["spec"]["template"]["spec"]
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/pdserve/kv-auth"]
        vol = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
        assert mount["readOnly"] and vol["secret"]["secretName"] == gen["name"]
        assert f"--disaggregation-auth-key-file={KEY_FILE}" in c["args"]
        assert '"key_file": "/etc/pdserve/kv-auth/store-key"' in " ".join(c["args"])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_refuses_without_keys_and_mounts_the_generated_secret(tmp_path):
    deploy = tmp_path / "k8s"
    shutil.copytree(K8S, deploy, ignore=shutil.ignore_patterns("*.key"))
    build = ["kubectl", "kustomize", str(deploy)]
    out = subprocess.run(build, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "kv-auth.key" in out.stderr  # fails closed: no key, no deployment
    for name in ("kv-auth.key", "store.key"):
        (deploy / name).write_text("k" * 44)
    out = subprocess.run(build, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"].startswith("pdserve-kv-auth-")  # hashed: a new key rolls the pods
    for d in docs:
        if d["kind"] == "StatefulSet":
            vols = d["spec"]["template"]["spec"]["volumes"]
            assert secret["metadata"]["name"] in [v.get("secret", {}).get("secretName") for v in vols]
