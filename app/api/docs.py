"""Swagger UI at /docs, served from this process.

FastAPI's default page loads Swagger UI from a CDN, which a GPU fleet's
network often cannot reach. The assets come from the `swagger-ui-py`
package (Swagger UI 5, which reads the OpenAPI 3.1 FastAPI writes).
"""

from __future__ import annotations

from pathlib import Path

import swagger_ui
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(swagger_ui.__file__).parent / "static"
_PREFIX = "/docs/assets"


def install(app: FastAPI) -> None:
    app.mount(_PREFIX, StaticFiles(directory=ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url=f"{_PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{_PREFIX}/swagger-ui.css",
            swagger_favicon_url=f"{_PREFIX}/favicon-32x32.png",
            swagger_ui_parameters={"persistAuthorization": True},
        )
