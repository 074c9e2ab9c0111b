"""The control plane and the router never import each other (DESIGN invariant 8)."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app"


def imported_modules(package: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted((APP / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        out[path.name] = names
    return out


def offenders(package: str, forbidden: str) -> list[str]:
    return [f"{f} imports {m}" for f, mods in imported_modules(package).items()
            for m in mods if m == forbidden or m.startswith(forbidden + ".")]


def test_control_does_not_import_the_router() -> None:
    assert imported_modules("control"), "no modules found: the check would pass vacuously"
    assert offenders("control", "app.router") == []


def test_router_does_not_import_the_control_plane() -> None:
    assert imported_modules("router")
    assert offenders("router", "app.control") == []
    assert offenders("router", "app.store") == []
