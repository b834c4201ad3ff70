"""Each level imports only downward (docs/ARCHITECTURE.md "Levels").

Every module of the package is read with ``ast`` (no import runs); every import it makes, at
module level or inside a function (``TYPE_CHECKING`` blocks included), must name a module of its
own group or of a lower level. Two groups on one level are siblings and import neither each
other. A module that no row of the table claims fails too, so a new module gets a place.

The top-level folders obey the same rule as boxes (``FOLDER_LEVELS``): a module imports from its
own folder or from a folder of a lower level, never from a sibling folder or one above, so the
folder picture has no arrow back up. The one exception is ``PUBLIC_ALIASES``: the ``pdserve.engine``
package's lazy ``Engine`` and ``python -m pdserve.engine``, public names of what lives in
``entrypoints/``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"engine": "pdserve.engine", "prefill": "pdserve.prefill", "decode": "pdserve.decode",
           "kvtransfer": "pdserve.kvtransfer", "router": "pdserve.router", "kernels": "pdserve.kernels",
           "entrypoints": "pdserve.entrypoints"}

# top-level package -> its folder level; the same table, in words, is docs/ARCHITECTURE.md's "Levels"
FOLDER_LEVELS: dict[str, int] = {
    "pdserve.kernels": 0,
    "pdserve.engine": 1,
    "pdserve.kvtransfer": 2,
    "pdserve.prefill": 3,
    "pdserve.decode": 3,
    "pdserve.router": 4,
    "pdserve.entrypoints": 5,
}

# the only imports of a folder above: module -> the modules it may name there (public names of
# what lives in entrypoints/: ``from pdserve.engine import Engine`` and ``python -m pdserve.engine``)
PUBLIC_ALIASES: dict[str, set[str]] = {
    "pdserve.engine": {"pdserve.entrypoints.engine"},
    "pdserve.engine.__main__": {"pdserve.entrypoints.cli"},
}

# (level, group, module prefixes), lowest first; a module belongs to the row of its longest prefix.
# The same table, in words, is docs/ARCHITECTURE.md's "Levels".
LEVELS: list[tuple[int, str, tuple[str, ...]]] = [
    (0, "kernels", ("pdserve.kernels",)),
    (0, "constrained", ("pdserve.engine.constrained",)),
    (1, "base", ("pdserve.engine.env", "pdserve.engine.version", "pdserve.engine.sampling_params",
                 "pdserve.engine.messages", "pdserve.engine.kv_events_config", "pdserve.engine.quantization_names",
                 "pdserve.engine.pd_rules", "pdserve.engine.json_flags", "pdserve.engine.http_limits", "pdserve.engine.http_site", "pdserve.engine.http_json_errors",
                 "pdserve.engine.speculative_names", "pdserve.engine.lora_names", "pdserve.engine.model_source", "pdserve.engine.prometheus_text",
                 "pdserve.engine.kv_transfer_config", "pdserve.engine.kv_auth", "pdserve.engine.transfer_backends",
                 "pdserve.engine.secret_files", "pdserve.engine.net_allowlist", "pdserve.engine.tracing")),
    (2, "mem_cache", ("pdserve.engine.mem_cache",)),
    (2, "text", ("pdserve.engine.text",)),
    (3, "model_executor", ("pdserve.engine.model_executor", "pdserve.engine.config")),
    (4, "kvtransfer", ("pdserve.kvtransfer",)),
    (4, "speculative", ("pdserve.engine.speculative",)),
    (5, "sched", ("pdserve.engine.sched", "pdserve.engine.server_config")),
    (6, "prefill", ("pdserve.prefill",)),
    (6, "decode", ("pdserve.decode",)),
    (6, "frontend", ("pdserve.engine.frontend",)),
    (7, "router", ("pdserve.router",)),
    (8, "entrypoints", ("pdserve.entrypoints", "pdserve.entrypoints.planner", "pdserve.engine", "pdserve.engine.__main__")),
]


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    out = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((pkg, *rel))] = path
    return out


def place(module: str) -> tuple[int, str] | None:
    """(level, group) of ``module``; None when no row claims it."""
    best = None
    for level, group, prefixes in LEVELS:
        for p in prefixes:
            # "pdserve.engine" claims the package itself only: its top modules each have a row
            hit = module == p if p == "pdserve.engine" else module == p or module.startswith(p + ".")
            if hit and (best is None or len(p) > best[0]):
                best = (len(p), level, group)
    return None if best is None else best[1:]


def imports(path: Path, name: str, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported pdserve module) of every import in the file, wherever it stands."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("pdserve.")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            if not base.startswith("pdserve."):
                continue
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in known else base))
    return out


def test_every_module_has_a_level():
    unplaced = sorted(m for m in modules() if place(m) is None)
    assert not unplaced, f"modules without a level (add them to LEVELS and docs/ARCHITECTURE.md): {unplaced}"


def test_no_import_reaches_up_or_sideways():
    known = modules()
    bad = []
    for name, path in known.items():
        mine = place(name)
        if mine is None:
            continue
        for line, target in imports(path, name, known):
            theirs = place(target)
            if theirs is None or theirs[1] == mine[1]:
                continue
            if theirs[0] >= mine[0]:
                where = "a higher" if theirs[0] > mine[0] else "a sibling"
                bad.append(f"{path.relative_to(ROOT)}:{line} ({mine[1]}, level {mine[0]}) imports {target} "
                           f"({where} level: {theirs[1]}, level {theirs[0]})")
    assert not bad, "imports against the levels:\n" + "\n".join(bad)


def folder(module: str) -> str:
    """The top-level package of ``module`` (``pdserve.engine.sched.x`` -> ``pdserve.engine``)."""
    return ".".join(module.split(".")[:2])


def test_every_folder_has_a_level():
    assert set(FOLDER_LEVELS) == set(FOLDERS.values())


def test_no_folder_imports_a_sibling_or_one_above():
    known = modules()
    bad = []
    for name, path in known.items():
        mine = folder(name)
        for line, target in imports(path, name, known):
            theirs = folder(target)
            if theirs == mine or FOLDER_LEVELS[theirs] < FOLDER_LEVELS[mine]:
                continue
            if target in PUBLIC_ALIASES.get(name, ()):
                continue
            where = "a higher" if FOLDER_LEVELS[theirs] > FOLDER_LEVELS[mine] else "a sibling"
            bad.append(f"{path.relative_to(ROOT)}:{line} ({mine}, folder level {FOLDER_LEVELS[mine]}) imports "
                       f"{target} ({where} folder: {theirs}, level {FOLDER_LEVELS[theirs]})")
    assert not bad, "imports against the folder levels:\n" + "\n".join(bad)


def test_the_public_aliases_are_the_ones_documented():
    """Each alias names a module that exists and is the only import of a folder above it in its
    file; the engine package says so in its docstring."""
    known = modules()
    for name, allowed in PUBLIC_ALIASES.items():
        above = {t for _, t in imports(known[name], name, known)
                 if FOLDER_LEVELS[folder(t)] > FOLDER_LEVELS[folder(name)]}
        assert above == allowed and allowed <= set(known), name
    assert "PUBLIC_ALIASES" in (ROOT / "engine" / "__init__.py").read_text()


def test_the_folder_check_sees_an_import_of_a_folder_above(tmp_path):
    """An import of router/ from engine/ is against the folder levels, one of engine/ from
    router/ is not (so the folder test above could fail)."""
    f = tmp_path / "m.py"
    f.write_text("from pdserve.router import worker_hook\n")
    known = {"pdserve.router.worker_hook": f}
    (target,) = [t for _, t in imports(f, "pdserve.engine.sched.m", known)]
    assert FOLDER_LEVELS[folder(target)] > FOLDER_LEVELS[folder("pdserve.engine.sched.m")]
    assert FOLDER_LEVELS[folder("pdserve.engine.text.prompt")] < FOLDER_LEVELS[folder("pdserve.router.kv.kv_aware_policy")]


def test_the_check_sees_upward_and_function_level_imports(tmp_path):
    """The reader finds an import inside a function and a `from pkg import submodule` (so the test
    above could fail)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from pdserve.entrypoints import cli\n"
                 "from pdserve.engine import env\n")
    known = {"pdserve.entrypoints.cli": f, "pdserve.engine.env": f}
    found = dict((t, line) for line, t in imports(f, "pdserve.engine.mem_cache.m", known))
    assert found == {"pdserve.entrypoints.cli": 2, "pdserve.engine.env": 3}
    assert place("pdserve.engine.mem_cache.m")[0] < place("pdserve.entrypoints.cli")[0]
    assert place("pdserve.engine.new_top_module") is None  # a new top module of engine needs a row


def test_the_architecture_page_states_the_same_levels():
    """docs/ARCHITECTURE.md's "Levels" table: one row per level, naming the same groups' packages."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Levels", 1)[1].split("\n## ", 1)[0].split("| folder level |", 1)[0]
    stated = {}
    for row in re.findall(r"^\| *(\d+) *\|([^|]*)\|", section, re.M):
        stated[int(row[0])] = set(re.findall(r"`([a-z_.]+)`", row[1]))
    expected = {}
    for level, _, prefixes in LEVELS:
        expected.setdefault(level, set()).update(p.removeprefix("pdserve.") for p in prefixes)
    assert stated == expected


def test_the_architecture_page_states_the_same_folder_levels():
    """docs/ARCHITECTURE.md's "Levels": the folder table, one row per folder level."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Levels", 1)[1].split("\n## ", 1)[0]
    table = section.split("| folder level |", 1)[1].split("\n\n", 1)[0]
    stated = {}
    for row in re.findall(r"^\| *(\d+) *\|([^|]*)\|", table, re.M):
        stated[int(row[0])] = set(re.findall(r"`([a-z_.]+)/`", row[1]))
    expected = {}
    for pkg, level in FOLDER_LEVELS.items():
        expected.setdefault(level, set()).add(pkg.removeprefix("pdserve."))
    assert stated == expected
