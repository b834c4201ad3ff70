"""scripts/benchlib/ab_rounds.py and revision_tree.py: the sides of an A/B benchmark take turns
(A B, then B A), a ratio is the median of the rounds' ratios with its spread, and another
checkout's files import as ``pdserve`` laid out by its own pyproject."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from benchlib.ab_rounds import round_ratios, timed  # noqa: E402
from benchlib.revision_tree import checkout_tree  # noqa: E402


def test_sides_alternate_and_every_round_is_kept():
    calls = []
    out = timed({"a": "A", "b": "B"}, lambda side: calls.append(side) or side.lower(), repeats=4)
    assert calls == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert {name: (o, len(ts)) for name, (o, _, ts) in out.items()} == {"a": ("a", 4), "b": ("b", 4)}
    for _, best, ts in out.values():
        assert best == min(ts)


def test_round_ratios_median_and_spread():
    # num's speed over den's, round by round: 2.0, 1.0, 1.5 (den's time over num's)
    r = round_ratios([1.0, 2.0, 2.0], [2.0, 2.0, 3.0])
    assert r == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert round_ratios([1.0, 1.0], [1.0, 3.0])["median"] == 2.0  # even count: the middle two's mean


def test_checkout_tree_imports_pdserve_from_the_other_checkout(tmp_path):
    src = tmp_path / "checkout"
    (src / "engine").mkdir(parents=True)
    (src / "engine" / "__init__.py").write_text("WHERE = 'other checkout'\n")
    (src / "router").mkdir()
    (src / "router" / "__init__.py").write_text("")
    (src / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"pdserve.engine" = "engine"\n"pdserve.engine.text" = "engine/text"\n'
        '"pdserve.router" = "router"\n')
    pkg = checkout_tree(str(src), str(tmp_path / "dest"))
    assert sorted(os.listdir(os.path.join(pkg, "pdserve"))) == ["__init__.py", "engine", "router"]
    env = {**os.environ, "PYTHONPATH": pkg}
    out = subprocess.run([sys.executable, "-c", "import pdserve.engine as e; print(e.WHERE)"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "other checkout"
