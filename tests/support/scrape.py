"""A gateway's /metrics, parsed with prometheus_client's own parser; with a
model's status, asked of a gateway's app in process."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from pydantic import BaseModel

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


async def model_status_and_metrics(app: Any, gw: Any, admin: str, model: str,
                                   puts: Iterable[tuple[str, BaseModel]]
                                   ) -> tuple[dict[str, Any], Samples]:
    """Writes `puts` to a started gateway's store, waits for its mirror to
    see them, then asks its app, in process, for `model`'s status
    (GET /admin/models/{model}) and its /metrics."""
    rev = 0
    for key, value in puts:
        rev = await gw.store.put(key, value.model_dump_json().encode())
    assert await gw.mirror.wait_for(rev, 5)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                 headers={"Authorization": f"Bearer {admin}"}) as c:
        status = (await c.get(f"/admin/models/{model}")).json()["status"]
        return status, samples((await c.get("/metrics")).text)
