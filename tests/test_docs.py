"""Swagger UI at /docs works without reaching any CDN."""

from __future__ import annotations

import re

import httpx

from tests.support.procs import Cluster


def test_docs_are_served_from_the_gateway_itself(solo: Cluster) -> None:
    gw = solo.gateway("docs", local_agent="false")
    page = httpx.get(gw.url + "/docs")
    assert page.status_code == 200
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets), page.text
    for asset in assets:
        assert asset.startswith("/"), f"{asset} would be fetched from another host"
        assert httpx.get(gw.url + asset).status_code == 200, asset

    spec = httpx.get(gw.url + "/openapi.json").json()
    assert spec["openapi"].startswith("3.1")  # Swagger UI 5 reads 3.1
    assert {"/admin/models/{name}", "/v1/chat/completions"} <= set(spec["paths"])
    schemes = spec["components"]["securitySchemes"]
    assert any(s["type"] == "http" and s["scheme"] == "bearer" for s in schemes.values())
