"""The house rules of app/ (docs/architecture.md, "Folders: the packages"):
short functions with few parameters, no two modules importing each other,
no module importing another's private name, and every package saying in
its `__init__.py` what it is and what each of its modules holds.

Read from the source with `ast`, nothing imported. Each rule is also run
against a crafted tree (tmp_path) that breaks it, so that none can pass by
reading nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAX_PARAMS = 8
MAX_LINES = 80
# The exceptions, each with its reason (also in the map's "Folders").
ALLOWED = {
    # A typer command's parameters are its command line: NAME, six options,
    # --gateway and --json; grouping them would change the CLI and its --help.
    ("app/ctl/keys.py", "create"),
}


def _modules(app: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(app.rglob("*.py")):
        parts = list(path.relative_to(app.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def long_functions(app: Path) -> list[str]:
    found = []
    for path in _modules(app).values():
        rel = path.relative_to(app.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if (rel, node.name) in ALLOWED:
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            if names and names[0] in ("self", "cls"):
                names = names[1:]
            params = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if params > MAX_PARAMS:
                found.append(f"{rel}:{node.lineno} {node.name} takes {params} parameters")
            if lines > MAX_LINES:
                found.append(f"{rel}:{node.lineno} {node.name} runs {lines} lines")
    return found


def _imports(app: Path) -> dict[str, set[str]]:
    """Each module's imports of app's modules, and (as `!name`) private names
    imported from one."""
    mods = _modules(app)
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module.split(".")[0] == app.name):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in mods:
                        deps.add(full)
                        continue
                    deps.add(node.module)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        deps.add(f"!{full}")
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == app.name}
        out[name] = deps
    return out


def cycles(app: Path) -> list[str]:
    imports = _imports(app)
    return sorted({" <-> ".join(sorted((a, b))) for a, deps in imports.items() for b in deps
                   if b != a and a in imports.get(b, ())})


def private_imports(app: Path) -> list[str]:
    return sorted(f"{mod} imports {dep[1:]}" for mod, deps in _imports(app).items()
                  for dep in deps if dep.startswith("!"))


def unlisted(app: Path) -> list[str]:
    """Packages whose docstring does not say each module as `- `name`: ...`."""
    found = []
    for init in sorted(app.rglob("__init__.py")):
        folder = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        members = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        members += [p.name + "/" for p in folder.iterdir()
                    if p.is_dir() and (p / "__init__.py").exists()]
        listed = {line.split("`")[1] for line in doc.splitlines()
                  if line.lstrip().startswith("- `") and line.count("`") >= 2}
        rel = folder.relative_to(app.parent).as_posix()
        if not doc.strip():
            found.append(f"{rel}: no docstring")
        for m in sorted(set(members) - listed):
            found.append(f"{rel}: `{m}` not listed")
        for m in sorted(listed - set(members)):
            found.append(f"{rel}: lists `{m}`, which is not there")
    return found


def test_functions_are_short_and_take_few_parameters() -> None:
    assert long_functions(ROOT / "app") == []


def test_no_two_modules_import_each_other() -> None:
    assert cycles(ROOT / "app") == []


def test_no_module_imports_another_s_private_name() -> None:
    assert private_imports(ROOT / "app") == []


def test_every_package_says_what_it_is_and_lists_its_modules() -> None:
    assert unlisted(ROOT / "app") == []


def test_each_rule_flags_a_tree_that_breaks_it(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "sub").mkdir(parents=True)
    (app / "__init__.py").write_text('"""The app.\n\n- `a`: one.\n- `gone`: none.\n"""\n')
    (app / "sub" / "__init__.py").write_text("")
    (app / "a.py").write_text("from app.b import _hidden\n\n"
                              "def wide(a, b, c, d, e, f, g, h, i):\n    pass\n")
    (app / "b.py").write_text("import app.a\n\n_hidden = 1\n\ndef tall():\n"
                              + "    x = 1\n" * MAX_LINES)
    assert long_functions(app) == ["app/a.py:3 wide takes 9 parameters",
                                   f"app/b.py:5 tall runs {MAX_LINES + 1} lines"]
    assert cycles(app) == ["app.a <-> app.b"]
    assert private_imports(app) == ["app.a imports app.b._hidden"]
    assert unlisted(app) == ["app: `b` not listed", "app: `sub/` not listed",
                             "app: lists `gone`, which is not there", "app/sub: no docstring"]
