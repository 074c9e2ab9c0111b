"""`llmgw ctl node ...` and `llmgw ctl quota ...`: the operator's choices for
nodes (cordon, drain, pool, labels) and capacity quotas, over the routes of
app/api/fleet.py. Registered by app/ctl/__init__.py."""

from __future__ import annotations

import sys
import urllib.parse
from typing import Annotated, Any

import typer
from rich.table import Column, Table
from rich.text import Text

from app.ctl.common import DEFAULT_GATEWAY, AsJson, Gateway, console, out, request, send, sub_app
from app.wire.names import check_labels, check_name

node_app = sub_app("A node's placement: cordon, uncordon, drain; its pool and labels "
                   "(conf); clear a GPU's fault (gpu-clear).")
quota_app = sub_app("Capacity quotas: the most GPUs the models naming a scope hold.")

NodeName = Annotated[str, typer.Argument(help="node name (from `llmgw ctl nodes`)")]
Scope = Annotated[str, typer.Argument(help="the quota scope (a model spec's `quota`)")]
IfMatch = Annotated[str | None, typer.Option(
    "--if-match", metavar="ETAG",
    help="write only if the record is still at ETAG (as `node conf` or `quota list --json` "
         "showed it); else the gateway's 412, nothing written")]


def _conditions(if_match: str | None) -> dict[str, str] | None:
    from app.ctl.catalog import quoted

    return {"If-Match": quoted(if_match)} if if_match is not None else None


def _node_path(node: str, rest: str) -> str:
    # safe="": a name holding "/" must not reach another route.
    return f"/admin/nodes/{urllib.parse.quote(node, safe='')}{rest}"


def _state(conf: dict[str, Any]) -> str:
    if conf.get("draining"):
        return "draining"
    return "cordoned" if conf.get("cordoned") else "schedulable"


def _labels(conf: dict[str, Any]) -> str:
    labels = conf.get("labels") or {}
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "none"


def conf_line(conf: dict[str, Any]) -> str:
    """A node's conf (GET /admin/nodes/{node}/conf) in a line."""
    return (f"node {conf.get('node', '?')}: {_state(conf)}, pool {conf.get('pool', '?')}, "
            f"labels {_labels(conf)}, engine build {conf.get('engine_build', '?')}")


def _act(node: str, action: str, gateway: str, as_json: bool) -> None:
    data = request(gateway, "POST", _node_path(node, f"/{action}"))
    if as_json:
        out(data, True)
    else:
        sys.stdout.write(conf_line(data) + "\n")


@node_app.command()
def cordon(node: NodeName, gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """No new replicas go to NODE; those on it stay."""
    _act(node, "cordon", gateway, as_json)


@node_app.command()
def uncordon(node: NodeName, gateway: Gateway = DEFAULT_GATEWAY,
             as_json: AsJson = False) -> None:
    """Replicas may be placed on NODE again; ends a drain."""
    _act(node, "uncordon", gateway, as_json)


@node_app.command()
def drain(node: NodeName, gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Cordon NODE and move its replicas to other nodes (uncordon ends it)."""
    _act(node, "drain", gateway, as_json)


@node_app.command("gpu-clear")
def gpu_clear(node: NodeName,
              index: Annotated[int, typer.Argument(min=0, help="the GPU's index on NODE")],
              gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Clear the fault GPU INDEX of NODE reports: replicas are placed on it
    again until it reports another."""
    data = request(gateway, "POST", _node_path(node, f"/gpus/{index}/clear"))
    if as_json:
        out(data, True)
        return
    reason = (data.get("gpu_cleared") or {}).get(str(index))
    said = f"fault cleared ({reason})" if reason else "healthy, nothing to clear"
    sys.stdout.write(f"node {node}: GPU {index} {said}; placement may use it\n")


def _label_pairs(pairs: list[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--label")
        labels[key] = value
    try:
        return check_labels(labels)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--label") from None


@node_app.command()
def conf(
    node: NodeName,
    pool: Annotated[str | None, typer.Option(
        "--pool", help="only profiles of this pool are placed on NODE")] = None,
    label: Annotated[list[str] | None, typer.Option(
        "--label", help="KEY=VALUE: set a label (repeat for more)")] = None,
    unlabel: Annotated[list[str] | None, typer.Option(
        "--unlabel", help="KEY: remove a label (repeat for more)")] = None,
    gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False, if_match: IfMatch = None,
) -> None:
    """Show NODE's conf and its ETag; with --pool, --label or --unlabel, change it
    (the rest is kept)."""
    if pool is not None:
        try:
            check_name(pool, "pool")
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--pool") from None
    setting = _label_pairs(label or [])
    removing = set(unlabel or [])
    if both := sorted(removing & setting.keys()):
        raise typer.BadParameter(f"{', '.join(both)} both set and removed",
                                 param_hint="--unlabel")
    changing = pool is not None or bool(setting) or bool(removing)
    if if_match is not None and not changing:
        raise typer.BadParameter("conditions a change: give --pool, --label or --unlabel too",
                                 param_hint="--if-match")
    path = _node_path(node, "/conf")
    answer = send(gateway, "GET", path)
    data = answer.json()
    if changing:
        # The PUT takes pool and labels whole: what is not changed is sent as
        # read. Without --if-match, another admin's change between the two
        # calls is overwritten (the gateway's write is conditioned, this read
        # is not); with it, the PUT is refused (412) unless nothing changed.
        labels = {k: v for k, v in (data.get("labels") or {}).items() if k not in removing}
        body = {"pool": data.get("pool", "default") if pool is None else pool,
                "labels": labels | setting}
        answer = send(gateway, "PUT", path, body=body, about=f"node {node}: ",
                      headers=_conditions(if_match))
        data = answer.json()
    if as_json:
        out(data, True)
        return
    grid = Table.grid(padding=(0, 2))
    for key, value in (("node", data.get("node", node)), ("state", _state(data)),
                       ("pool", data.get("pool", "?")), ("labels", _labels(data)),
                       ("engine build", data.get("engine_build", "?")),
                       *([("etag", answer.headers["etag"])] if "etag" in answer.headers else [])):
        grid.add_row(key, Text(str(value)))
    console().print(grid)


@quota_app.command("list")
def list_quotas(gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Every scope: its limit, the GPUs its models' replicas hold, those models."""
    data = request(gateway, "GET", "/admin/quotas")
    table = Table("SCOPE", Column("MAX GPUS", justify="right"),
                  Column("USED GPUS", justify="right"), "MODELS")
    for q in data:
        limit = q.get("max_gpus")
        table.add_row(Text(q["scope"]), "no limit" if limit is None else str(limit),
                      str(q.get("used_gpus", 0)), Text(", ".join(q.get("models") or [])))
    out(data, as_json, table)


def _quota_path(scope: str) -> str:
    return f"/admin/quotas/{urllib.parse.quote(scope, safe='')}"


@quota_app.command("set")
def set_quota(
    scope: Scope,
    max_gpus: Annotated[int, typer.Option(
        "--max-gpus", min=0, max=100_000, help="the most GPUs the scope's replicas hold")],
    gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False, if_match: IfMatch = None,
) -> None:
    """Set SCOPE's limit: no replica is placed that would take its models past it."""
    data = send(gateway, "PUT", _quota_path(scope), body={"max_gpus": max_gpus},
                about=f"quota {scope}: ", headers=_conditions(if_match)).json()
    if as_json:
        out(data, True)
    else:
        sys.stdout.write(f"quota {data.get('scope', scope)}: at most "
                         f"{data.get('max_gpus', max_gpus)} GPUs\n")


@quota_app.command("delete")
def delete_quota(scope: Scope, gateway: Gateway = DEFAULT_GATEWAY,
                 if_match: IfMatch = None) -> None:
    """Remove SCOPE's limit (its models are no longer held to one)."""
    send(gateway, "DELETE", _quota_path(scope), about=f"quota {scope}: ",  # 204, no body
         headers=_conditions(if_match))
    sys.stdout.write(f"quota {scope} deleted\n")
