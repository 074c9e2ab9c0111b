"""The cluster page at /cluster: the fleet on one page for an operator's
browser (docs/design/cluster-page.md).

Static files from app/api/static, served with a strict Content Security
Policy: scripts and styles from this gateway only, no inline code, fetches
to this gateway only. The page holds no data of its own; its script reads
/admin with the admin token the operator types, which it keeps in the tab's
sessionStorage, and writes every value as text.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse

from app.api.errors import Problem

STATIC = Path(__file__).parent / "static"
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # A fresh page after an upgrade: the files are small.
    "Cache-Control": "no-cache",
}
_FILES = {"cluster.js": "text/javascript", "cluster.css": "text/css",
          "favicon.svg": "image/svg+xml",
          "actions.js": "text/javascript",
          "charts.js": "text/javascript", "charts.css": "text/css"}


def install(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/cluster")

    @app.get("/cluster", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "cluster.html", media_type="text/html",
                            headers=_HEADERS)

    @app.get("/cluster/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        media = _FILES.get(name)
        if media is None:  # only the page's own files: never a path
            raise Problem(404, "Not found", f"no file {name!r} here")
        return FileResponse(STATIC / name, media_type=media, headers=_HEADERS)
