"""bench/RESULTS.md holds several benchmarks' last runs: each rewrites its
own section and leaves the others (bench/sections.py). Before it, a run of
bench/router_overhead.py rewrote the whole file, dropping the others."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support.procs import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import sections


def test_a_benchmark_rewrites_its_section_and_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    sections.replace_section(path, "control_scale", "## Control\n\ncontrol_scale: a=1")
    sections.replace_section(path, "router_overhead", "# Router\n\nrouter_overhead: b=1")
    sections.replace_section(path, "serve.sh guidellm", "serve: c=1")
    sections.replace_section(path, "router_overhead", "# Router\n\nrouter_overhead: b=2\n")
    text = path.read_text()
    assert "control_scale: a=1" in text and "serve: c=1" in text
    assert "router_overhead: b=2" in text and "b=1" not in text
    # In the order first written, each once.
    order = [text.index(sections.markers(n)[0])
             for n in ("control_scale", "router_overhead", "serve.sh guidellm")]
    assert order == sorted(order) and text.count("<!-- router_overhead: begin -->") == 1


def test_the_repositorys_results_have_each_section_marked() -> None:
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    for name in ("control_scale", "router_overhead"):
        start, end = sections.markers(name)
        assert text.count(start) == 1 and text.count(end) == 1
        assert text.index(start) < text.index(end)
