"""The documentation is complete and its links resolve.

- Every flag that ``pdserve serve --help``, ``pdserve router --help`` and
  ``pdserve launch --help`` print is written somewhere in README.md or
  docs/**/*.md as the literal ``--flag-name`` (a boolean's ``--no-x`` counts as
  documented with ``--x``).
- Every relative link and image in those files (and in results/**/*.md) points to an existing file or
  folder, and a ``#anchor`` into a markdown file names one of its headings
  (GitHub's slugs).

The CLIs run as the user runs them (``python -m``, help only: no model, no
torch import), so the test follows the parsers wherever they live.
"""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAG_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # where a flag counts as documented
DOC_FILES = [*FLAG_DOCS, *sorted((ROOT / "results").rglob("*.md"))]  # whose links must resolve

# the help of each command: python -m <module> <args> --help
COMMANDS = {
    "pdserve serve": ["-m", "pdserve.engine", "--help"],
    "pdserve router": ["-m", "pdserve.router", "--help"],
    "pdserve launch": ["-m", "pdserve.entrypoints.cli", "launch", "--help"],
}

# an option as argparse prints it at the start of a help line, or after ", " (aliases)
_OPTION_LINE = re.compile(r"^ {2}(-[^ ].*?)(?: {2,}|$)")
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*[a-z0-9]")


def help_flags(args: list[str]) -> set[str]:
    """The long flags in the options list of one command's ``--help``."""
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stderr[-2000:]}"
    flags = set()
    for line in out.stdout.splitlines():
        m = _OPTION_LINE.match(line)
        if m:
            flags.update(_FLAG.findall(m.group(1)))
    flags.discard("--help")
    assert flags, f"no flags parsed from {' '.join(args)} --help:\n{out.stdout[:2000]}"
    return flags


def documented_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in FLAG_DOCS)


def undocumented(flags: set[str], text: str) -> list[str]:
    present = set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*[a-z0-9](?![\w-])", text))
    missing = []
    for flag in sorted(flags):
        if flag in present:
            continue
        if flag.startswith("--no-") and "--" + flag[len("--no-"):] in present:
            continue
        missing.append(flag)
    return missing


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_cli_flag_is_documented(command):
    missing = undocumented(help_flags(COMMANDS[command]), documented_text())
    assert not missing, (
        f"{len(missing)} flag(s) of `{command} --help` appear nowhere in README.md or docs/**/*.md "
        f"as the literal flag; document each (e.g. in the flag tables of docs/USER_GUIDE.md or "
        f"docs/ROUTER.md):\n  " + "\n  ".join(missing))


def test_flag_matching_is_literal():
    text = "use `--max-total-tokens 8` or --enable-metrics; not --page-size-x"
    assert undocumented({"--max-total-tokens", "--no-enable-metrics", "--page-size", "--max"}, text) == [
        "--max", "--page-size"]


# ---- links --------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HTML = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.I)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but - and _ dropped,
    spaces to -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LN").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return out


def link_targets(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    text = _CODE_SPAN.sub("", text)
    return _LINK.findall(text) + _REF_DEF.findall(text) + _HTML.findall(text)


def _show(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in link_targets(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file {_show(dest)}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {_show(dest)}")
    return broken


def test_every_relative_link_resolves():
    problems = [f"{_show(p)}: {b}" for p in DOC_FILES for b in broken_links(p)]
    assert not problems, "broken links:\n  " + "\n  ".join(problems)


def test_slugs_and_link_check(tmp_path):
    assert github_slug("Conditional disaggregation: `1p1d+local` and the `interference` workload") == (
        "conditional-disaggregation-1p1dlocal-and-the-interference-workload")
    assert github_slug("`kv_aware` routing") == "kv_aware-routing"
    (tmp_path / "a.md").write_text("# Top\n## Same\n## Same\n```\n# not a heading\n```\n")
    assert anchors(tmp_path / "a.md") == {"top", "same", "same-1"}
    (tmp_path / "b.md").write_text(
        "[ok](a.md#same-1) [bad](a.md#not-a-heading) ![img](missing.png) [web](https://x.org/y)\n"
        "`[in code](nowhere.md)` [self](#here)\n## Here\n")
    assert broken_links(tmp_path / "b.md") == [
        f"a.md#not-a-heading: no heading with anchor #not-a-heading in {_show(tmp_path / 'a.md')}",
        f"missing.png: no such file {_show(tmp_path / 'missing.png')}",
    ]
