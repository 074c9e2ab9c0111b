"""`llmgw ctl model put|delete` and `llmgw ctl catalog export|apply`: the
catalog written over PUT and DELETE /admin/models/{name} and read from GET
/admin/catalog and /admin/models (app/api/admin.py). Registered by
app/ctl/__init__.py.

`model put` sends a spec as written and the gateway checks it (its 422
names the field; the spec it already has is written nothing, "unchanged");
with `--if-match` (the ETag `model show` prints) only if
the model is still as read (412 otherwise). `catalog apply` checks the
whole file here first, with the gateway's own rules
(app/wire/catalog.py), so that a bad file changes nothing; only the
gateway's model roots are left to the gateway. Each of its writes is
conditioned on the model's ETag as it compared it.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from app.ctl.common import DEFAULT_GATEWAY, AsJson, Gateway, fail, out, request, send, sub_app
from app.ctl.waiting import wait_ready
from app.wire import catalog as rules
from app.wire.spec import ModelSpec

model_app = sub_app("One model in the catalog: show, put (create or replace its "
                    "spec), delete.")
catalog_app = sub_app("The whole catalog: export it (LLMGW_CATALOG_FILE's form), "
                      "apply such a file.")

ModelName = Annotated[str, typer.Argument(help="the model's name, as clients ask for it")]
DocFile = Annotated[str, typer.Argument(help="a YAML or JSON file; - for stdin")]

# Any absolute path is under "/": whether weights on a path are allowed is
# the gateways' LLMGW_MODEL_ROOTS, which only they know.
_ANY_ROOT = ("/",)


def model_path(name: str) -> str:
    # "/" stays: model names may hold it and the route takes it ({name:path}).
    return "/admin/models/" + urllib.parse.quote(name, safe="/")


def read_document(path: str) -> Any:
    """A YAML or JSON document from `path` (`-`: stdin); one line on failure."""
    where = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        fail(f"{where} is not text (UTF-8)")
    as_json = path.endswith(".json")
    try:
        return json.loads(text) if as_json else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        fail(f"{where} is not valid {'JSON' if as_json else 'YAML or JSON'}: "
             + " ".join(str(exc).split()))


def status_line(m: dict[str, Any]) -> str:
    """How a model's replicas stand (GET /admin/models/{name}'s status), in a line."""
    st = m.get("status") or {}
    health = st.get("health") or {}
    line = (f"{m.get('name', '?')}: {st.get('ready', 0)}/{st.get('wanted', 0)} ready, "
            f"{st.get('replicas', 0)} placed, health {health.get('state', '?')}")
    if health.get("detail"):
        line += f" ({health['detail']})"
    if st.get("unplaced"):
        line += f"; not placed: {st['unplaced']}"
    failed = [f"{f.get('id')} on {f.get('node')}" for f in st.get("failed") or []]
    if failed:
        line += f"; failed: {', '.join(failed)}"
    return " ".join(line.split())


def quoted(tag: str) -> str:
    """An ETag as If-Match takes it: "*", or quoted (the shell may eat the quotes)."""
    tag = tag.strip()
    return tag if tag == "*" or tag.startswith(('"', 'W/"')) else f'"{tag}"'


@model_app.command("put")
def put(name: ModelName, file: DocFile, gateway: Gateway = DEFAULT_GATEWAY,
        as_json: AsJson = False,
        if_match: Annotated[str | None, typer.Option(
            "--if-match", metavar="ETAG",
            help="replace only if NAME is still at ETAG (as `model show` printed it); "
                 "'*': only if it exists")] = None,
        create: Annotated[bool, typer.Option(
            "--create", help="only create: refused if NAME exists")] = False) -> None:
    """Create or replace NAME's spec from FILE (fields as PUT /admin/models/NAME takes)."""
    where = "stdin" if file == "-" else file
    spec = read_document(file)
    if not isinstance(spec, dict):
        fail(f"{where}: expected a model's spec, a mapping of fields (model, gpus, ...)")
    if set(spec) == {"models"}:
        fail(f"{where} is a catalog ({{models: ...}}): give it to `llmgw ctl catalog apply`")
    try:
        json.dumps(spec)
    except (TypeError, ValueError) as exc:  # YAML reads dates and sets too
        fail(f"{where}: a value JSON cannot carry: {exc}")
    conditions = {"If-None-Match": "*"} if create else {}
    if if_match is not None:
        conditions["If-Match"] = quoted(if_match)
    before = current_catalog(gateway).get(name)
    status = send(gateway, "PUT", model_path(name), body=spec, about=f"model {name}: ",
                  headers=conditions).status
    data = request(gateway, "GET", model_path(name))
    # The gateway writes nothing for the spec it has (its ETag stays).
    result = "created" if status == 201 else "unchanged" if (
        before is not None and data.get("etag") == before[1]) else "updated"
    if as_json:
        out({"result": result, "model": data}, True)
        return
    sys.stdout.write(f"model {name} {result}\n{status_line(data)}\n")


@model_app.command("show")
def show(name: ModelName, gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """NAME's spec as YAML that `model put` takes back, then how its replicas stand."""
    data = request(gateway, "GET", model_path(name))
    if as_json:
        out(data, True)
        return
    spec = {k: v for k, v in data.items() if k not in ("name", "created", "status", "etag")}
    tag = data.get("etag")
    sys.stdout.write(f"# {status_line(data)}\n"
                     + (f"# etag {tag}: put it back with --if-match '{tag}'\n" if tag else "")
                     + yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))


@model_app.command("delete")
def delete(name: ModelName, gateway: Gateway = DEFAULT_GATEWAY,
           if_match: Annotated[str | None, typer.Option(
               "--if-match", metavar="ETAG",
               help="delete only if NAME is still at ETAG (as `model show` printed it)")
           ] = None) -> None:
    """Remove NAME from the catalog; the leader stops its replicas."""
    send(gateway, "DELETE", model_path(name), about=f"model {name}: ",  # 204, no body
         headers={"If-Match": quoted(if_match)} if if_match is not None else None)
    sys.stdout.write(f"model {name} deleted\n")


@catalog_app.command("export")
def export(
    as_yaml: Annotated[bool, typer.Option("--yaml", help="YAML instead of JSON")] = False,
    gateway: Gateway = DEFAULT_GATEWAY,
) -> None:
    """Print the catalog in LLMGW_CATALOG_FILE's form (save it, edit it, `apply` it)."""
    text = send(gateway, "GET", "/admin/catalog", headers={
        "Accept": "application/yaml" if as_yaml else "application/json"}).body.decode()
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def parse_catalog(data: Any, where: str) -> dict[str, ModelSpec]:
    """The file's specs, checked as the gateway checks them (but for model
    roots); every error in one line otherwise."""
    try:
        return rules.parse_catalog(data, _ANY_ROOT)
    except rules.CatalogError as exc:
        # A seed is one transaction of at most MAX_SEEDED_MODELS; apply puts
        # one model at a time, so that limit is not apply's.
        errors = [e for e in exc.errors if e.loc != ("models",)]
        if errors:
            fail(f"{where}: {rules.CatalogError(errors)}")
        return {str(n): ModelSpec.model_validate(raw or {})
                for n, raw in data["models"].items()}


def current_catalog(gateway: str) -> dict[str, tuple[dict[str, Any], str]]:
    """The gateway's catalog: name -> (spec as written, as export gives it; its ETag)."""
    listed = request(gateway, "GET", "/admin/models")
    return {str(m["name"]): ({k: v for k, v in m.items()
                              if k not in ("name", "created", "status", "etag")},
                             str(m.get("etag") or "*"))
            for m in (listed if isinstance(listed, list) else []) if isinstance(m, dict)}


@catalog_app.command("apply")
def apply(
    file: DocFile,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="check FILE, read the catalog and say what apply would do to "
        "each model; change nothing")] = False,
    prune: Annotated[bool, typer.Option(
        "--prune", help="also delete the models that FILE does not name")] = False,
    wait: Annotated[bool, typer.Option(
        "--wait", help="then show progress until every model of FILE has the replicas it "
        "wants ready; exit status 1 at --timeout, naming those not ready and why")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0, help="seconds --wait waits (an engine may load for "
        "LLMGW_ENGINE_START_TIMEOUT, 1800 s)")] = 1800,
    gateway: Gateway = DEFAULT_GATEWAY,
) -> None:
    """Put each model of FILE (`catalog export`'s form: {models: {NAME: spec}})."""
    where = "stdin" if file == "-" else file
    specs = parse_catalog(read_document(file), where)
    current = current_catalog(gateway)  # read-only: a dry run reads it too
    # External models first, then the others, adapters last; pruned in the
    # reverse order: another's overflow (docs/design/catalog.md, "Spill-over")
    # and an adapter's base (docs/design/lora-adapters.md) must exist before it
    # and outlive it.
    def order(spec: ModelSpec) -> int:
        return 0 if spec.external is not None else 2 if spec.adapter is not None else 1

    for name, spec in sorted(specs.items(), key=lambda item: order(item[1])):
        body = spec.spec_dump()
        seen = current.get(name)
        if seen is not None and seen[0] == body:
            # Not written again: a write would bump the catalog's serial and
            # wake every gateway's mirror for nothing.
            result = "unchanged"
        elif dry_run:
            result = "would be " + ("created" if seen is None else "updated")
        else:
            # Conditioned on what was compared: a model changed (or created)
            # meanwhile by someone else is a 412, not overwritten.
            status = send(gateway, "PUT", model_path(name), body=body,
                          about=f"model {name}: ", headers=(
                              {"If-Match": seen[1]} if seen is not None
                              else {"If-None-Match": "*"})).status
            result = "created" if status == 201 else "updated"
        sys.stdout.write(f"model {name}{':' if dry_run else ''} {result}\n")
    for name in sorted(set(current) - set(specs), key=lambda n: (
            0 if "adapter" in current[n][0] else 2 if "external" in current[n][0] else 1, n)):
        if dry_run:
            sys.stdout.write(f"model {name}: would be " + (
                "deleted\n" if prune else f"kept: not in {where} (--prune deletes it)\n"))
        elif prune:
            send(gateway, "DELETE", model_path(name), about=f"model {name}: ",
                 headers={"If-Match": current[name][1]})
            sys.stdout.write(f"model {name} deleted\n")
        else:
            sys.stdout.write(f"model {name} kept: not in {where} (--prune deletes it)\n")
    if dry_run:
        sys.stdout.write(f"{where}: {len(specs)} models, valid (dry run: nothing changed)\n")
        return
    if wait:
        sys.stdout.flush()
        wait_ready(gateway, {name: spec.spec_dump() for name, spec in specs.items()}, timeout)
