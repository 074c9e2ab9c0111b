"""Benchmarks run without tests/ and where pytest is not installed
(docs/architecture.md, "Folders: the packages"): no bench/*.py imports tests/ or pytest,
and what tests share with them (the throwaway etcd) is bench's."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.support.procs import ROOT

# Run with pytest unimportable, as in a venv without the `test` extra.
NO_PYTEST = "import sys; sys.modules['pytest'] = None; "


def imported_from_tests(path: str) -> set[str]:
    """Every module of tests/ that `path` imports, at its top or in a function."""
    tree = ast.parse((ROOT / path).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n == "pytest" or n.split(".")[0] == "tests"}


def run_without_pytest(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_PYTEST + code], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_benches_import_nothing_of_tests_nor_pytest() -> None:
    benches = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "bench").glob("*.py"))
    assert "bench/control_scale.py" in benches, "no benches found: the check would pass vacuously"
    wanted = {m: b for b in benches for m in imported_from_tests(b)}
    assert wanted == {}, f"benches import tests/ or pytest: {wanted}"


def test_the_throwaway_etcd_imports_no_pytest() -> None:
    # control_scale.py starts it; tests/support/etcd.py wraps it in fixtures.
    done = run_without_pytest("sys.path.insert(0, 'bench'); import etcd_server; "
                              "assert not any(m.split('.')[0] == 'tests' for m in sys.modules)")
    assert done.returncode == 0, done.stderr


def test_control_scale_runs_its_help_without_pytest() -> None:
    done = run_without_pytest("import runpy; sys.argv = ['control_scale.py', '--help']; "
                              "runpy.run_path('bench/control_scale.py', run_name='__main__')")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
