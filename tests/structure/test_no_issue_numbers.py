"""No issue numbers in the tree: code, tests, docs, scripts, manifests and raw outputs say what and
why in their own words ("issue 27: ...", "(issue 12)", "(#27)", a file named ``issue17_...`` would
send a reader to a tracker they may not have)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# "issue 27", "issues 12", "Issue-27", "issue17", "(#27)", " #27"
ISSUE_REF = re.compile(r"\bissues?[-_ ]?\d+|\(#\d+\)|(?:^|[\s(])#\d{1,4}\b", re.I)
BINARY = {".png", ".jpg", ".gif", ".so", ".pt", ".safetensors", ".gguf", ".bin"}
SKIP = {"requirements.lock"}  # package hashes and versions, not prose
THIS = Path(__file__).resolve()  # its examples are the forms it looks for


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def issue_refs(text: str) -> list[str]:
    return [m.group(0).strip() for m in ISSUE_REF.finditer(text)]


def test_no_file_names_or_cites_an_issue_number():
    found = []
    for path in tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if issue_refs(rel):
            found.append(f"{rel}: its name")
        if path.suffix in BINARY or path.name in SKIP or path == THIS or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if refs := issue_refs(line):
                found.append(f"{rel}:{n}: {refs}")
    assert not found, "say what and why instead of citing an issue:\n" + "\n".join(found[:40])


def test_the_pattern_finds_each_form_and_spares_ordinary_text():
    for cited in ("issue 27: the doubling backoff", "(issue 12)", "see #27", "(#27)", "Issue-3", "issue17_gemm",
                  "issues 12 and 13"):
        assert issue_refs(cited), cited
    for plain in ("the issue's defaults", "color: #fff", "x#3", "an issue of memory", "tissue 3d",
                  "http://h/#section-2"):
        assert not issue_refs(plain), plain
