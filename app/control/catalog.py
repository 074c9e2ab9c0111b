"""The catalog file, seeding, export.

The rules across a spec's fields and across the catalog are in
app/wire/catalog.py (`llmgw ctl` applies them too); every catalog write goes
through them, the admin API (`PUT /admin/models/{name}`) and the seed from
`LLMGW_CATALOG_FILE` alike, so nothing invalid reaches the store
(docs/design/catalog.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from app.control import state as s
from app.store.base import Compare, Put, Store
from app.wire.catalog import CatalogError, FieldError, parse_catalog


def load_file(path: Path, model_roots: Sequence[str],
              key_dir: str | None = None) -> dict[str, s.ModelSpec]:
    """The catalog file: YAML, or JSON (which YAML reads too)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CatalogError([FieldError((), f"cannot read {path}: {exc.strerror}")]) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise CatalogError([FieldError((), f"{path} is not valid "
                                           f"{'JSON' if path.suffix == '.json' else 'YAML'}: "
                                           f"{exc}")]) from None
    return parse_catalog(data, model_roots, key_dir)


def stored_value(name: str, created: float, spec: s.ModelSpec) -> bytes:
    """The value of `catalog/models/{name}`: the spec as given, name, created."""
    return json.dumps(spec.spec_dump() | {"name": name, "created": created}).encode()


def export(models: Mapping[str, s.StoredModel]) -> dict[str, Any]:
    """The catalog in the catalog file's form: export -> file -> seed round-trips."""
    return {"models": {name: models[name].spec_dump() for name in sorted(models)}}


async def seed(store: Store, models: Mapping[str, s.ModelSpec], by: str, now: float) -> bool:
    """Writes `models` as the catalog if the store has none; True if this call did.

    One transaction, conditioned on `catalog/serial` being absent (it is
    written by every catalog write, this one included): of several gateways
    starting together only one seeds, and a catalog edited since is never
    overwritten by a restart. A store holding models but no serial (written
    by a version before the serial) is left alone too.
    """
    if (await store.range(s.MODELS)).kvs:
        return False
    ops = [Put(s.MODELS + name, stored_value(name, now, spec))
           for name, spec in sorted(models.items())]
    bump = Put(s.CATALOG_SERIAL, json.dumps({"by": by, "seeded": True}).encode())
    res = await store.txn([Compare.absent(s.CATALOG_SERIAL)], [*ops, bump])
    return res.succeeded
