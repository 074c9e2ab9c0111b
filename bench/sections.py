"""bench/RESULTS.md holds the last run of several benchmarks, each in its
own section between two markers: a benchmark rewrites its section and
leaves the others as they are."""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


def replace_section(path: Path, name: str, body: str) -> None:
    """Writes `body` as section `name` of `path`: in place of the old one,
    or at the end when there is none."""
    start, end = markers(name)
    section = f"{start}\n{body.strip()}\n{end}"
    old = path.read_text() if path.exists() else ""
    if start in old and end in old:
        new = old[:old.index(start)] + section + old[old.index(end) + len(end):]
    else:
        new = (old.rstrip("\n") + "\n\n" if old.strip() else "") + section + "\n"
    path.write_text(new)
