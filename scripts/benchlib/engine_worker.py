"""One pdserve Engine in a process of its own, driven by ``bench_engine.py`` over its stdin and stdout.

Each side of a benchmark gets its own process, so each has one OpenMP pool: Engines sharing a
process each bring one, and libgomp then throttles its barrier spin for all of them (every
side's steps ran slower, most at 2 threads). The Engine imported is whatever ``pdserve`` the
process finds first, so with ``PYTHONPATH`` at another revision's tree (``revision_tree``) the
same messages measure that revision.

Messages are JSON lines. In: ``{"engine": {Engine kwargs}}`` once, then ``{"generate":
{"input_ids": [[...]], "sampling_params": {...}}}`` any number of times; out: ``{"ready": true}``
and then ``{"output_ids": [[...]]}`` per generate, or ``{"error": "..."}``. End of input shuts
the Engine down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib


def revision_tree(repo: str, rev: str, dest: str) -> str:
    """A ``PYTHONPATH`` entry under ``dest`` that imports ``pdserve`` as it was at git revision
    ``rev`` of ``repo``: its files, laid out as its pyproject's package-dir says."""
    src, pkg = os.path.join(dest, "src"), os.path.join(dest, "pkg")
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", repo, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    with open(os.path.join(src, "pyproject.toml"), "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    os.makedirs(os.path.join(pkg, "pdserve"))
    open(os.path.join(pkg, "pdserve", "__init__.py"), "w").close()
    for name, path in package_dir.items():
        parts = name.split(".")
        if len(parts) == 2 and parts[0] == "pdserve":  # top-level subpackages; the rest lie inside them
            os.symlink(os.path.join(src, path), os.path.join(pkg, "pdserve", parts[1]))
    return pkg


def main() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the Engine prints goes to stderr; stdout carries the replies
    engine = None
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            try:
                if "engine" in msg:
                    from pdserve.engine import Engine

                    engine = Engine(**msg["engine"])
                    reply = {"ready": True}
                else:
                    res = engine.generate(**msg["generate"])
                    reply = {"output_ids": [r["output_ids"] for r in res]}
            except Exception as e:  # noqa: BLE001 - the benchmark shows it and stops
                reply = {"error": f"{type(e).__name__}: {e}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        if engine is not None:
            engine.shutdown()


if __name__ == "__main__":
    main()
