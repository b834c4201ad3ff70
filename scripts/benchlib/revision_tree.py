"""Another version of this checkout, importable as ``pdserve``: for benchmarks that measure
"before" in the same run (``bench_engine.py --baseline-rev`` and ``--baseline-tree``)."""

from __future__ import annotations

import os
import subprocess
import tomllib


def revision_tree(repo: str, rev: str, dest: str) -> str:
    """A ``PYTHONPATH`` entry under ``dest`` that imports ``pdserve`` as it was at git revision
    ``rev`` of ``repo``: its files (``git archive``), laid out as its pyproject's package-dir says."""
    src = os.path.join(dest, "src")
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", repo, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    return checkout_tree(src, dest)


def checkout_tree(src: str, dest: str) -> str:
    """A ``PYTHONPATH`` entry under ``dest`` that imports ``pdserve`` from the checkout at ``src``
    (e.g. ``git worktree add src REV``): a ``pdserve`` package of links to its top-level
    subpackages, as its own pyproject's package-dir lays them out."""
    src, pkg = os.path.abspath(src), os.path.join(dest, "pkg")
    with open(os.path.join(src, "pyproject.toml"), "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    os.makedirs(os.path.join(pkg, "pdserve"))
    open(os.path.join(pkg, "pdserve", "__init__.py"), "w").close()
    for name, path in package_dir.items():
        parts = name.split(".")
        if len(parts) == 2 and parts[0] == "pdserve":  # top-level subpackages; the rest lie inside them
            os.symlink(os.path.join(src, path), os.path.join(pkg, "pdserve", parts[1]))
    return pkg
