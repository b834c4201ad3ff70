"""The documentation is complete and its links resolve.

- Every flag that ``pdserve serve --help``, ``pdserve router --help`` and
  ``pdserve launch --help`` print is written somewhere in README.md or
  docs/**/*.md as the literal ``--flag-name`` (a boolean's ``--no-x`` counts as
  documented with ``--x``).
- Every ``--flag`` those pages name exists: a flag of one of pdserve's commands
  (``--help`` of each), of a script (``add_argument``, or a flag table's
  ``snake_case`` names), of a shell script, or one of ``EXTERNAL_FLAGS``.
- Every relative link and image in those files (and in results/**/*.md) points to an existing file or
  folder, and a ``#anchor`` into a markdown file names one of its headings
  (GitHub's slugs).
- Every name those pages put in backticks that looks like code exists in the
  tree: a ``CamelCase`` class or a ``name()`` call is defined somewhere in the
  Python files (one ast scan), ``Class.member`` is a member of that class or of
  a base, a ``dir/file.ext`` path is a file of the repository, and
  ``tests/x.py::test_y`` names a function or class of that file. Names from
  other projects are listed in ``EXTERNAL_NAMES`` and ``EXTERNAL_PATHS``.

The CLIs run as the user runs them (``python -m``, help only: no model, no
torch import), so the test follows the parsers wherever they live.
"""

from __future__ import annotations

import ast
import builtins
import functools
import os
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

# pdserve's other commands: their flags are documented where they are explained, and a page may name them
MORE_COMMANDS = {name: ["-m", "pdserve.entrypoints.cli", name.split()[1], "--help"]
                 for name in ("pdserve profile", "pdserve plan", "pdserve planner")}

# flags that pages name and no parser here has, each for a reason
EXTERNAL_FLAGS = {
    "--build-arg",  # docker build
    "--from-literal",  # kubectl create secret
    "--router-host-cache-hit-weight", "--router-disk-cache-hit-weight",  # NVIDIA Dynamo's router
    "--mem-fraction",  # the former name the user guide maps to --mem-fraction-static
    "--mem", "--no-x",  # the user guide's examples of a refused abbreviation and of a boolean's negation
}

# an option as argparse prints it at the start of a help line, or after ", " (aliases)
_OPTION_LINE = re.compile(r"^ {2}(-[^ ].*?)(?: {2,}|$)")
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*[a-z0-9]")


def help_flags(args: list[str]) -> set[str]:
    """The long flags in the options list of one command's ``--help`` (each command run once per session)."""
    return set(_help_flags(tuple(args)))


@functools.lru_cache(maxsize=None)
def _help_flags(args: tuple[str, ...]) -> frozenset[str]:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stderr[-2000:]}"
    flags = set()
    for line in out.stdout.splitlines():
        m = _OPTION_LINE.match(line)
        if m:
            flags.update(_FLAG.findall(m.group(1)))
    flags.discard("--help")
    assert flags, f"no flags parsed from {' '.join(args)} --help:\n{out.stdout[:2000]}"
    return frozenset(flags)


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


# ---- names of code ------------------------------------------------------------------------------

# names that pages cite from other projects (their code is not in this tree)
EXTERNAL_NAMES = {
    "CollectorRegistry",  # prometheus_client
    "CudaGraphRunner",  # SGLang's class the CUDA graph runner follows
    "MemAvailable",  # a field of /proc/meminfo
    "RecreateGroupOnPodRestart",  # a LeaderWorkerSet restart policy
    "init_process_group",  # torch.distributed
    "madvise",  # libc
}
EXTERNAL_PATHS = ("python/sglang/", "vllm/")  # files of SGLang and vLLM that pages point to
_MEMBERLESS_BASES = {"object", "ABC", "Protocol", "Generic"}  # bases that give a class no members a page names
_SKIP_DIRS = {".venv", ".git", "node_modules", "build", "dist", "__pycache__"}
_CAMEL = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+")  # two humps at least: not NGRAM, not Engine
_TEST_REF = re.compile(r"([\w/.-]+\.py)((?:::\w+)+)")  # tests/x.py::test_y (pytest's node id)
_CODE_REF = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\(.*\))?")  # a dotted name, maybe called
_PATH = re.compile(r"(?<![\w./~<$-])((?:[\w.-]+/)+[\w.-]+\.(?:py|c|h|md|sh|yaml|yml|jsonl|json|toml|txt|png))(?![\w/])")


class CodeIndex:
    """What the Python tree defines, by name: functions and classes anywhere, each class's members
    (methods, class attributes, ``self.x`` assignments) and bases, parameters (callbacks are called by
    their parameter's name), identifier-like string constants (registered names such as
    architectures), and what each file defines (for ``tests/x.py::test_y``)."""

    def __init__(self, sources: dict[str, str]):
        self.defined: set[str] = set()
        self.members: dict[str, set[str]] = {}
        self.bases: dict[str, set[str]] = {}
        self.by_file: dict[str, set[str]] = {}  # relative path -> its functions and classes
        self.flags: set[str] = set()  # add_argument("--x") anywhere, and --x for every "snake_case" string
        for path, text in sources.items():
            self._scan(ast.parse(text), self.by_file.setdefault(path, set()))

    def _scan(self, tree: ast.AST, in_file: set[str]) -> None:
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defined.add(node.name)
                in_file.add(node.name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                self.defined.update(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                self.defined.add(node.value)
                if "_" in node.value.strip("_"):  # a flag table's entry (compare_disagg's, the configs')
                    self.flags.add("--" + node.value.strip("_").replace("_", "-"))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--"):
                self.flags.add(node.value.split("=")[0])  # add_argument("--x"), a forwarded ["--x", v]
            if isinstance(node, ast.ClassDef):
                members = self.members.setdefault(node.name, set())
                self.bases.setdefault(node.name, set()).update(
                    b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute)))
                for sub in ast.walk(node):
                    if sub is node:
                        continue
                    if isinstance(sub, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        members.add(sub.name)
                    elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                        members.add(sub.id)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        members.add(sub.attr)

    def has_member(self, cls: str, name: str, seen: frozenset = frozenset()) -> bool:
        """Whether ``cls`` or a base defines ``name``; a base from another project (``nn.Module``,
        ``msgspec.Struct``) may, so it counts as yes."""
        if cls not in self.members:
            return cls not in _MEMBERLESS_BASES
        if name in self.members[cls]:
            return True
        return any(self.has_member(b, name, seen | {cls}) for b in self.bases[cls] - seen)


def _code_spans(text: str):
    """(line number, span) for each inline code span outside fenced blocks."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keep the line numbers
    for n, line in enumerate(text.splitlines(), 1):
        for m in re.finditer(r"`([^`\n]+)`", line):
            yield n, m.group(1).strip()


def unknown_names(text: str, index: CodeIndex, files: list[str]) -> list[str]:
    """The code names and paths of one page that the tree does not define, as ``line: what``."""
    known = index.defined | EXTERNAL_NAMES | set(dir(builtins))
    problems = []
    for n, span in _code_spans(text):
        for path in _PATH.findall(span):
            path = path.removeprefix("./")
            if path.startswith(EXTERNAL_PATHS) or any(f == path or f.endswith("/" + path) for f in files):
                continue
            problems.append(f"{n}: no file {path}")
        t = _TEST_REF.fullmatch(span)
        if t:
            path = t.group(1).removeprefix("./")
            defined = set().union(*(names for f, names in index.by_file.items() if f == path or f.endswith("/" + path)))
            problems += [f"{n}: no {name} in {path}" for name in t.group(2).split("::")[1:] if name not in defined]
            continue
        m = _CODE_REF.fullmatch(span)
        if not m:
            continue  # a formula, a command line, a literal: not a name
        parts = m.group(1).split(".")
        for i, part in enumerate(parts):
            if _CAMEL.fullmatch(part) and part not in known:
                problems.append(f"{n}: no class {part}")
            elif i and part not in known and parts[i - 1] in index.members and not index.has_member(parts[i - 1], part):
                problems.append(f"{n}: {parts[i - 1]} has no member {part}")
        call = parts[-1]
        if m.group(2) and len(call) > 1 and call not in known:
            problems.append(f"{n}: no function {call}()")
    return problems


@functools.lru_cache(maxsize=1)
def tree_index() -> tuple[CodeIndex, list[str]]:
    """The ast index of every Python file of the repository, and every file's path (relative)."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]  # never walk .venv
        files += [Path(folder) / n for n in names]
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in files if p.suffix == ".py"}
    return CodeIndex(sources), sorted(str(p.relative_to(ROOT)) for p in files)


def test_every_named_function_class_and_file_exists():
    index, files = tree_index()
    problems = [f"{_show(p)}:{b}" for p in FLAG_DOCS
                for b in unknown_names(p.read_text(encoding="utf-8"), index, files)]
    assert not problems, (
        "names in backticks that the tree does not define (fix the page, or add a name from another "
        "project to EXTERNAL_NAMES):\n  " + "\n  ".join(problems))


def test_name_check_finds_what_is_missing():
    index = CodeIndex({"tests/router/test_m.py": (
        "class Base:\n    def step(self): pass\n"
        "class RankLoop(Base):\n    KIND = 1\n    def __init__(self):\n        self.pool = None\n"
        "def build_loop(after_layer):\n    after_layer(0)\n"
        "ARCHS = {'llama': 'LlamaForCausalLM'}\n")})
    files = ["engine/sched/loop.py", "docs/A.md", "tests/router/test_m.py"]
    text = ("`RankLoop.step()` `RankLoop.pool` `RankLoop.KIND` `build_loop()` `after_layer(i)` `LlamaForCausalLM`\n"
            "`sched/loop.py` `min(a, b)` `c(1) = 1.39` `--flag` `python/sglang/srt/x.py` `/tmp/out.jsonl`\n"
            "`RankLoop.run()` `GoneLoop` `gone()` `pdserve.engine.MissingClass` `engine/gone.py`\n"
            "`router/test_m.py::build_loop` `test_m.py::RankLoop::step` `tests/router/test_m.py::test_gone`\n"
            "```\n`NotChecked` in a fence\n```\n")
    assert unknown_names(text, index, files) == [
        "3: RankLoop has no member run", "3: no function run()", "3: no class GoneLoop", "3: no function gone()",
        "3: no class MissingClass", "3: no file engine/gone.py", "4: no test_gone in tests/router/test_m.py"]


# ---- flags a page names -------------------------------------------------------------------------

_NAMED_FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*[a-z0-9](?![\w-])")


def unknown_flags(text: str, known: set[str]) -> list[str]:
    """The ``--flags`` of one page (code blocks included) that no parser knows, as ``line: flag``; a
    boolean's ``--no-x`` and ``--x`` stand for each other."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        for flag in _NAMED_FLAG.findall(line):
            bare = flag[len("--no-"):] if flag.startswith("--no-") else flag[len("--"):]
            if not {flag, "--" + bare, "--no-" + bare} & known:
                problems.append(f"{n}: {flag}")
    return problems


def test_every_flag_a_page_names_exists():
    index, files = tree_index()
    known = {"--help"} | index.flags | EXTERNAL_FLAGS
    for args in [*COMMANDS.values(), *MORE_COMMANDS.values()]:
        known |= help_flags(args)
    for f in files:
        if f.endswith(".sh"):
            known.update(_NAMED_FLAG.findall((ROOT / f).read_text(encoding="utf-8")))
    problems = [f"{_show(p)}:{b}" for p in FLAG_DOCS for b in unknown_flags(p.read_text(encoding="utf-8"), known)]
    assert not problems, (
        "flags that no pdserve command, script or EXTERNAL_FLAGS entry has (fix the page):\n  "
        + "\n  ".join(problems))


def test_unknown_flags_finds_a_removed_flag():
    text = "`--page-size 16` and --no-enable-metrics\n```\npdserve serve --gone-flag 1 --enable-metrics\n```\n"
    assert unknown_flags(text, {"--page-size", "--no-enable-metrics"}) == ["3: --gone-flag"]
