"""Every file, function and setting the design docs name exists.

The docs (docs/architecture.md, docs/design/*.md, docs/reliability.md,
README.md) are read by someone who then opens what they name; a name that
moved without the docs following is a dead end. Checked here, from the
repository's own files (no import of app/, so a module that fails to import
is still read):

- a path under app/, tests/, bench/, scripts/, compose/, deploy/ or docs/
  exists (file or folder);
- `Class.method` and `module.function` in backticks, where `Class` is a
  class of app/ or `module` a module of app/ (its last dotted part, or the
  whole dotted path `app.x.y`), name something defined there (ast: a
  function, class, assignment or attribute set on `self`); a CamelCase name
  that no module of app/ defines fails too, unless it is listed below as a
  library's;
- a `name.py` in backticks is a file somewhere in the repository;
- an `LLMGW_*` variable is read by app/, scripts/, bench/, compose/ or tests/
  (the last three: the benchmarks', the compose fleet's and the suite's own
  variables): written there literally, or a field of a settings group
  (prefix `LLMGW_`).

The check is a function of a root folder (`missing_names(root)`), so a test
can run it on a copy with a wrong name written in.

The other way round, the code's comments cite the docs by page and section:
in a file under app/, tests/, bench/, scripts/, compose/ or deploy/, each
docs/*.md or docs/design/*.md named exists, and a citation
`docs/<path>.md, "Name"` or `docs/<path>.md ("Name")` (the path and the
quoted name on one line; further names joined by `and "Other"` are checked
too) names one of that file's headings (`#`, `##`, ...), compared
case-sensitively once backticks and emphasis are stripped
(`bad_citations(root)`).
"""

from __future__ import annotations

import ast
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DOCS = ("docs/architecture.md", "docs/design/*.md", "docs/reliability.md", "README.md")
TOP = ("app", "tests", "bench", "scripts", "compose", "deploy", "docs")
SETTINGS_FROM = ("app", "scripts", "bench", "compose", "tests")
# A dotted name ending in one of these is a file name, not code.
FILE_SUFFIXES = frozenset({"py", "js", "css", "html", "md", "json", "yaml", "yml", "cfg",
                           "toml", "sh", "txt", "service", "pid", "sqlite", "db", "log"})

# CamelCase names in backticks that belong to libraries the docs talk about,
# not to app/: a `Name.attr` of one of these is not checked.
LIBRARY_CLASSES = frozenset({
    "APIError", "AsyncOpenAI", "BaseModel", "BaseSettings", "ChatCompletionRequest",
    "ClientSession", "ClientTimeout", "CounterMetricFamily", "EngineCoreRequest",
    "FastAPI", "HTTPException", "OpenAI", "Request", "Response", "SamplingParams",
    "Llama", "StreamingResponse", "TestClient", "Timeout", "UploadFile",
})

PATH_RE = re.compile(
    r"(?<![\w./$-])((?:" + "|".join(TOP) + r")/[A-Za-z0-9_./-]*[A-Za-z0-9_/])")
TICKS_RE = re.compile(r"`([^`\n]+)`")
DOTTED_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(.*\))?$")
PYFILE_RE = re.compile(r"^([A-Za-z0-9_]+\.py)$")
SETTING_RE = re.compile(r"\bLLMGW_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)")


@dataclass
class Code:
    """What app/ defines, read with ast."""

    modules: dict[str, set[str]] = field(default_factory=dict)  # dotted path -> names
    by_last: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    classes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    bases: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    settings: set[str] = field(default_factory=set)

    def class_has(self, cls: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
        if attr in self.classes.get(cls, ()):
            return True
        return any(self.class_has(b, attr, seen | {cls})
                   for b in self.bases.get(cls, ()) if b not in seen)


def _names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _class_members(cls: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
        elif isinstance(node, ast.Assign):
            members.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            members.add(node.attr)
    return members


def read_code(root: Path) -> Code:
    code = Code()
    for path in sorted((root / "app").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        dotted = ".".join(parts)
        tree = ast.parse(path.read_text(), filename=str(path))
        code.modules[dotted] = _names(tree)
        code.by_last[parts[-1]].append(dotted)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                code.classes[node.name] |= _class_members(node)
                bases = {b.id if isinstance(b, ast.Name) else b.attr
                         for b in node.bases if isinstance(b, ast.Name | ast.Attribute)}
                code.bases[node.name] |= bases
                if bases & {"Group", "BaseSettings"}:
                    code.settings |= {"LLMGW_" + m.upper() for m in _class_members(node)}
    for top in SETTINGS_FROM:
        for path in (root / top).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".sh", ".toml", ".cfg", ""}:
                try:
                    code.settings |= set(SETTING_RE.findall(path.read_text()))
                except (UnicodeDecodeError, OSError):
                    continue
    return code


def _doc_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for pattern in DOCS:
        files += sorted(root.glob(pattern))
    return files


def _check_dotted(code: Code, name: str) -> str | None:
    """Why `name` (`X.y` or `a.b.c`) is missing, or None when it is defined
    or is not app/'s."""
    parts = name.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None
    if parts[0] == "app" and ("app." + parts[1]) not in code.modules:
        return None  # a logger's name (`app.access`) or an ASGI app's method
    if parts[0] == "app":
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in code.modules:
                rest = parts[cut:]
                if not rest or rest[0] in code.modules[module]:
                    return None if len(rest) < 2 or code.class_has(rest[0], rest[1]) \
                        else f"{rest[0]} has no {rest[1]}"
                return f"{module} defines no {rest[0]}"
        return "no such module"
    head, attr = parts[0], parts[1]
    if head in code.classes:
        return None if code.class_has(head, attr) else f"class {head} has no {attr}"
    if head in code.by_last:
        if any(attr in code.modules[m] for m in code.by_last[head]):
            return None
        # `mirror.revision`: an instance named after its module's class
        if any(code.class_has(n, attr) for m in code.by_last[head]
               for n in code.modules[m] if n.lower() == head.replace("_", "")):
            return None
        return f"module {head} ({', '.join(code.by_last[head])}) defines no {attr}"
    if head[:1].isupper() and head[1:2].islower() and head not in LIBRARY_CLASSES:
        return f"no class {head} in app/"
    return None


def missing_names(root: Path) -> list[str]:
    """Each name the docs under `root` give that `root` lacks, with where."""
    code = read_code(root)
    repo_files = {p.name for top in TOP if (root / top).is_dir()
                  for p in (root / top).rglob("*.py")}
    problems: list[str] = []
    for doc in _doc_files(root):
        where = doc.relative_to(root)
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            at = f"{where}:{lineno}"
            for path in PATH_RE.findall(line):
                path = path.rstrip("/.")
                if path.endswith("'s"):
                    path = path[:-2]
                if not (root / path).exists():
                    problems.append(f"{at}: path {path} does not exist")
            for tick in TICKS_RE.findall(line):
                tick = tick.strip()
                m = DOTTED_RE.match(tick.split("/")[0].split(" ")[0])
                if m and not PATH_RE.match(tick):
                    why = _check_dotted(code, m.group(1))
                    if why:
                        problems.append(f"{at}: `{m.group(1)}`: {why}")
                f = PYFILE_RE.match(tick)
                if f and f.group(1) not in repo_files:
                    problems.append(f"{at}: file {f.group(1)} is nowhere in the repository")
            for setting in SETTING_RE.findall(line):
                if setting not in code.settings:
                    problems.append(f"{at}: setting {setting} is read nowhere")
    return problems


def test_every_name_the_docs_give_exists() -> None:
    problems = missing_names(ROOT)
    assert not problems, "\n".join(problems)


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for top in TOP:
        if (ROOT / top).is_dir():
            shutil.copytree(ROOT / top, root / top,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "node_modules"))
    shutil.copy(ROOT / "README.md", root / "README.md")
    return root


def test_a_wrong_name_fails(tmp_path: Path) -> None:
    """A copy of the repository with one wrong name of each kind written into
    its map: each is reported, and nothing else new is."""
    root = _copy(tmp_path)
    before = set(missing_names(root))
    setting = "LLMGW_" + "NO_SUCH_SETTING"  # not written whole: this file is in tests/
    doc = root / "docs" / "architecture.md"
    doc.write_text(doc.read_text() + "\nSee app/router/no_such_module.py, "
                   "`RouteTable.no_such_method()`, `mirror.no_such_function`, "
                   f"`NoSuchClass.run()`, `no_such_file.py` and {setting}.\n")
    new = set(missing_names(root)) - before
    text = "\n".join(sorted(new))
    for wrong in ("app/router/no_such_module.py", "RouteTable.no_such_method",
                  "mirror.no_such_function", "NoSuchClass.run", "no_such_file.py",
                  setting):
        assert wrong in text, text
    assert len(new) == 6, text


CITED_FROM = ("app", "tests", "bench", "scripts", "compose", "deploy")
# Our docs' layout: docs/*.md and docs/design/*.md (an upstream project's
# docs/usage/x.md, cited in a comment, is not ours to check).
OUR_DOC = r"docs/((?:design/)?[\w.-]+\.md)"
PAGE_RE = re.compile(r"\b" + OUR_DOC + r"\b")
CITE_RE = re.compile(r"\b" + OUR_DOC + r'(?:, | \()"([^"\n]+)"((?:,? and "[^"\n]+")*)')
MORE_RE = re.compile(r'"([^"\n]+)"')
HEADING_RE = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
MARKUP = "`*_ "


def headings(doc: Path) -> set[str]:
    """The headings of a markdown file, markup stripped; none inside a fence."""
    found: set[str] = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING_RE.match(line)):
            found.add(m.group(1).strip(MARKUP))
    return found


def bad_citations(root: Path) -> list[str]:
    """Each `docs/<path>.md` the code under `root` names that is missing, and
    each `docs/<path>.md, "Name"` whose file has no heading Name, with
    where."""
    problems: list[str] = []
    cache: dict[str, set[str] | None] = {}
    for top in CITED_FROM:
        for path in sorted((root / top).rglob("*")) if (root / top).is_dir() else ():
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for lineno, line in enumerate(text.splitlines(), 1):
                at = f"{path.relative_to(root)}:{lineno}"
                for doc in {"docs/" + page for page in PAGE_RE.findall(line)}:
                    if doc not in cache:
                        cache[doc] = headings(root / doc) if (root / doc).is_file() else None
                    if cache[doc] is None:
                        problems.append(f"{at}: {doc} does not exist")
                for m in CITE_RE.finditer(line):
                    found = cache["docs/" + m.group(1)]
                    if found is None:
                        continue
                    doc = "docs/" + m.group(1)
                    for name in [m.group(2), *MORE_RE.findall(m.group(3))]:
                        if name.strip(MARKUP) not in found:
                            problems.append(f'{at}: {doc} has no heading "{name}"')
    return problems


def test_every_cited_section_is_a_heading() -> None:
    problems = bad_citations(ROOT)
    assert not problems, "\n".join(problems)


def test_a_wrong_citation_fails(tmp_path: Path) -> None:
    """A small tree whose code cites headings that are there (one in
    backticks, one the page's title) and wrong ones: a name that is not a
    heading, one differing only in case, a line inside a fence, a second name
    joined by `and`, a page that does not exist. Each wrong one is reported,
    and nothing else."""
    (tmp_path / "docs" / "design").mkdir(parents=True)
    (tmp_path / "docs" / "design" / "page.md").write_text(
        "# The page\n\n## `Real section`\n\n```\n# Fenced, not a heading\n```\n")
    (tmp_path / "app").mkdir()
    # Not written whole with a name: this file is itself in tests/.
    page, gone = "docs/design/" + "page.md", "docs/design/" + "gone.md"
    (tmp_path / "app" / "mod.py").write_text(
        f'# Right ({page}, "Real section"), and ({page} ("The page")).\n'
        f'# Wrong ({page}, "No such section") and\n'
        f'# ({page}, "real section"), ({page}, "Fenced, not a heading"),\n'
        f'# ({page}, "Real section" and "Not there"), ({gone}, "X").\n')
    text = "\n".join(bad_citations(tmp_path))
    for wrong in (f'app/mod.py:2: {page} has no heading "No such section"',
                  f'app/mod.py:3: {page} has no heading "real section"',
                  f'app/mod.py:3: {page} has no heading "Fenced, not a heading"',
                  f'app/mod.py:4: {page} has no heading "Not there"',
                  f"app/mod.py:4: {gone} does not exist"):
        assert wrong in text, text
    assert len(text.splitlines()) == 5, text
