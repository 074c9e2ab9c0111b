"""The catalog's settings: which weights and provider key files a model
may name, the catalog file a new store is seeded from, and how often the
router's tables are published again. Read by app/control's catalog rules,
the admin API and app/gateway/publish.py."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator

from app.control.catalog import load_file
from app.gateway.settings._group import Group


class CatalogSettings(Group):
    # --- the catalog ------------------------------------------------------------
    # Comma-separated folders a model given as a file path must lie under (on
    # the nodes; the gateway checks the path's shape, not its existence). A
    # path elsewhere is refused, so an admin token cannot point engines at
    # /etc or another tenant's weights. Add the folders your nodes keep
    # weights in; hub ids ("org/name") need none.
    model_roots: str = "/models,/var/lib/llmgw/models"
    # The folder (on every gateway host) an external model's api_key_file
    # must lie in (docs/design/security.md, "Files an admin names").
    # Keep only provider keys there: an admin can have any file in it sent
    # to a URL of its choosing. Empty: no key files at all. Never data_dir.
    provider_key_dir: str = "/etc/llmgw/keys"
    # A catalog ({"models": {name: spec}}, YAML or JSON, the form
    # GET /admin/catalog exports) written to the store by the first gateway
    # to start while the store has no catalog; ignored once it has one (edit
    # it through /admin then). Checked at start: a bad file stops the gateway,
    # naming the model and field. Its check reads the two above: they must
    # stay declared before it.
    catalog_file: Path | None = None
    # Seconds between republishes of the router's tables when nothing
    # changes: the backstop that picks up a rotated external provider key
    # (its api_key_file is reread each interval). Shorter: a rotated key is
    # used sooner, for a pass over the mirrored replicas each time.
    publish_interval: float = Field(10.0, gt=0)

    @field_validator("catalog_file")
    @classmethod
    def _catalog_file(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        if v is not None:
            roots = _root_list(info.data.get("model_roots", ""))
            # Raises CatalogError (a ValueError) naming each field.
            load_file(v, roots, key_dir=info.data.get("provider_key_dir", ""))
        return v

    @property
    def model_root_list(self) -> list[str]:
        return _root_list(self.model_roots)


def _root_list(roots: str) -> list[str]:
    return [r.strip().rstrip("/") or "/" for r in roots.split(",") if r.strip()]
