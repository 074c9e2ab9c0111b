"""The router compiled by mypyc (app/compiled.py): a copy runs only while it
matches its source, the suite runs the copy that ships, and the source
keeps to what mypyc compiles as Python runs it."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import compiled

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the compiled source."""
    root = tmp_path / "src"
    for f in compiled.sources():
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, root / f)
    return root


def built(tmp_path: Path, root: Path, **changes: object) -> Path:
    """A copy's folder holding the manifest a build of `root` writes."""
    copy = tmp_path / "copy"
    copy.mkdir(exist_ok=True)
    made = compiled.manifest(root, "2.4.1") | changes
    (copy / compiled.MANIFEST).write_text(json.dumps(made))
    return copy


def test_a_copy_runs_only_while_every_source_file_matches(tmp_path: Path, tree: Path) -> None:
    copy = built(tmp_path, tree)
    assert compiled.check(copy, tree) == (True, "compiled by mypyc 2.4.1")

    relay = tree / "app" / "router" / "relay.py"
    relay.write_text(relay.read_text() + "\n")
    assert compiled.check(copy, tree) == (
        False, "pure Python: app/router/relay.py changed since the compiled copy was built")

    copy = built(tmp_path, tree)
    http1 = tree / "app" / "gateway" / "http1.py"  # compiled alone in its package
    http1.write_text(http1.read_text() + "\n")
    assert compiled.check(copy, tree) == (
        False, "pure Python: app/gateway/http1.py changed since the compiled copy was built")

    copy = built(tmp_path, tree)
    (tree / "app" / "router" / "usage" / "new.py").write_text("X = 1\n")
    assert compiled.check(copy, tree) == (
        False, "pure Python: the router's files changed since the compiled copy was built")


def test_a_copy_of_another_interpreter_or_none_is_not_run(
        tmp_path: Path, tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ok, why = compiled.check(built(tmp_path, tree, python="3.12.0 (other)"), tree)
    assert not ok and why == "pure Python: the compiled copy was built for another interpreter"

    ok, why = compiled.check(tmp_path / "none", tree)
    assert not ok and why.startswith("pure Python: no compiled copy in this environment")

    (tmp_path / "copy" / compiled.MANIFEST).write_text("{")
    ok, why = compiled.check(tmp_path / "copy", tree)
    assert not ok and why.startswith("pure Python: the compiled copy's manifest is unreadable")

    copy = built(tmp_path, tree)
    monkeypatch.setenv(compiled.OFF, "off")
    assert compiled.check(copy, tree) == (False, "pure Python: LLMGW_ROUTER_COMPILED=off")


def test_the_suite_runs_the_compiled_router_that_ships() -> None:
    """scripts/install.sh builds the copy and scripts/test.sh rebuilds a
    stale one: under CI, and wherever a copy was built, the router the
    tests run is the compiled one."""
    out = subprocess.run([sys.executable, "-m", "app.compiled", "state"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    state = out.stdout.strip()
    if os.environ.get("CI") == "true" or (compiled.home() / compiled.MANIFEST).exists():
        assert state.startswith("compiled by mypyc"), (
            f"{state} (python -m app.compiled build makes it again)")
        # In this process too: extension modules, the router's and the
        # server protocol's.
        from app.gateway import http1
        from app.router import proxy
        assert proxy.__file__ is not None and proxy.__file__.endswith(".so")
        assert http1.__file__ is not None and http1.__file__.endswith(".so")
    else:
        assert out.returncode == 0 and state.startswith("pure Python: no compiled copy")


def _names_reused_across_types(path: Path) -> list[str]:
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        types: dict[str, set[str]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                types.setdefault(node.name, set()).add(ast.unparse(node.type))
        found += [f"{path.name}:{fn.lineno} {fn.name}: {name} for {sorted(t)}"
                  for name, t in types.items() if len(t) > 1]
    return found


def test_no_function_names_two_kinds_of_exception_alike() -> None:
    """mypyc gives a name one type in a function: `except A as exc` then
    `except B as exc` made the second clause raise TypeError, compiled
    (a retry of a replica's 503 became the gateway's 500)."""
    found = [hit for f in compiled.sources() for hit in _names_reused_across_types(ROOT / f)]
    assert found == []


def _awaits_in_handlers(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Try | ast.TryStar):
            continue
        blocks = [("except", h.body) for h in node.handlers]
        if node.finalbody:
            blocks.append(("finally", node.finalbody))
        for kind, body in blocks:
            found += [f"{path.name}:{sub.lineno} {kind}: {ast.unparse(sub)[:60]}"
                      for stmt in body for sub in ast.walk(stmt)
                      if isinstance(sub, ast.Await | ast.AsyncWith | ast.AsyncFor)]
    return found


def test_no_await_in_an_except_or_finally_block() -> None:
    """A compiled coroutine suspended in an except or finally block leaves
    the exception it handles as the thread's, for every other task, and for
    good once it leaves by another exception (docs/design/hot-path.md, "The
    router compiled"): after a continuation cut at its first-byte limit,
    every request held for a cold start answered 500."""
    found = [hit for f in compiled.sources() for hit in _awaits_in_handlers(ROOT / f)]
    assert found == []


def test_the_check_finds_an_await_in_either_block(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("async def f(x):\n    try:\n        pass\n    except ValueError:\n"
                   "        await x\n    finally:\n        async with x:\n            pass\n")
    assert [hit.split(" ")[1] for hit in _awaits_in_handlers(bad)] == ["except:", "finally:"]


def test_the_build_type_checks_where_no_extra_is_installed(tmp_path: Path) -> None:
    """scripts/install.sh compiles before the `test` extra, and an operator
    may never install `otel`: the build's type check must pass where an
    optional package is missing (it failed the install's build once, on
    app/router/tracing.py's OpenTelemetry imports). Checked as the build
    checks, with an interpreter that has no package at all."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True,
                   timeout=60)
    work = tmp_path / "work"
    work.mkdir()
    compiled.build_tree(ROOT, work)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir",
         str(tmp_path / "cache"), "--python-executable", str(bare / "bin" / "python"),
         *[str(f) for f in compiled.sources()]],
        cwd=work, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
