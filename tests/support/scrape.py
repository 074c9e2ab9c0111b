"""A gateway's /metrics, parsed with prometheus_client's own parser."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_text(url: str) -> str:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def samples(text: str) -> Samples:
    """(sample name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def collected(collector: Collector) -> Samples:
    """What one collector of ours renders, on its own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return samples(generate_latest(registry).decode())


def served_names(text: str) -> set[str]:
    """Every series name a query may use: a gauge's name, a counter's
    `_total`, a histogram's `_bucket`, `_sum` and `_count`, also for a
    family with no samples yet (a labelled counter nothing counted). The
    parser strips `_total` off a counter's family name: that bare name is
    no series and is left out."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        if fam.type in ("gauge", "unknown"):
            names.add(fam.name)
        elif fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
        names |= {s.name for s in fam.samples}
    return names
