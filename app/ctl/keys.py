"""`llmgw ctl keys ...`: client keys, over /admin/keys (app/api/keys.py).

The key itself is printed by `create` alone, once: the gateway keeps only
its hash and listings show its prefix (DESIGN invariant 6).
"""

from __future__ import annotations

import math
import re
import sys
import time
import urllib.parse
from typing import Annotated, Any

import typer
from rich.table import Column, Table
from rich.text import Text

from app.ctl.common import DEFAULT_GATEWAY, AsJson, Gateway, console, out, request, sub_app, when

app = sub_app("Client API keys: create (the key is shown once), list, show, "
              "revoke, usage.")

KeyId = Annotated[str, typer.Argument(help="the key's id (from `llmgw ctl keys list`)")]

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")


def parse_duration(text: str) -> float:
    """'30d', '12h', '90m', '45s' or plain seconds ('3600') -> seconds (> 0)."""
    match = _DURATION.fullmatch(text.strip().lower())
    seconds = float(match[1]) * _UNITS[match[2]] if match else 0.0
    if not 0 < seconds < math.inf:
        raise ValueError(f"{text!r} is not a duration: give e.g. 30d, 12h, 90m or 3600 (seconds)")
    return seconds


def _path(key_id: str, rest: str = "") -> str:
    # safe="": an id holding "/" must not reach another route.
    return f"/admin/keys/{urllib.parse.quote(key_id, safe='')}{rest}"


def _models(rec: dict[str, Any]) -> str:
    return ", ".join(rec.get("models") or []) or "all"


def _limits(rec: dict[str, Any]) -> str:
    lim = rec.get("limits") or {}
    said = [f"{lim[name]} {unit}" for name, unit in (
        ("requests_per_minute", "rpm"), ("tokens_per_minute", "tpm"),
        ("concurrent_requests", "concurrent"),
        ("external_tokens_per_day", "external tokens/day")) if lim.get(name) is not None]
    return ", ".join(said) or "none"


def _expiry(rec: dict[str, Any]) -> str:
    if rec.get("expires") is None:
        return "never"
    expired = rec.get("expired", rec["expires"] <= time.time())
    return when(rec["expires"]) + (" (expired)" if expired else "")


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="who or what the key is for")],
    model: Annotated[list[str] | None, typer.Option(
        "--model", help="a model the key may use (repeat for more); none: all")] = None,
    rpm: Annotated[int | None, typer.Option(
        "--rpm", min=1, help="requests per minute, all gateways together")] = None,
    tpm: Annotated[int | None, typer.Option(
        "--tpm", min=1, help="prompt + completion tokens per minute")] = None,
    concurrency: Annotated[int | None, typer.Option(
        "--concurrency", min=1, help="requests in flight at once")] = None,
    external_tpd: Annotated[int | None, typer.Option(
        "--external-tokens-per-day", min=1,
        help="tokens a day served by models' overflow providers (spill-over)")] = None,
    expires_in: Annotated[str | None, typer.Option(
        "--expires-in", help="stops working after: 30d, 12h, 90m or seconds")] = None,
    expires: Annotated[float | None, typer.Option(
        "--expires", min=0, help="stops working at this Unix time")] = None,
    gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """Create a client key; it is printed once, never again."""
    body: dict[str, Any] = {"name": name, "models": model or [], "limits": {
        "requests_per_minute": rpm, "tokens_per_minute": tpm, "concurrent_requests": concurrency,
        "external_tokens_per_day": external_tpd}}
    if expires_in is not None and expires is not None:
        raise typer.BadParameter("give --expires-in or --expires, not both",
                                 param_hint="--expires-in")
    if expires_in is not None:
        try:
            body["expires_in"] = parse_duration(expires_in)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--expires-in") from None
    if expires is not None:
        body["expires"] = expires
    data = request(gateway, "POST", "/admin/keys", body=body)
    if as_json:
        out(data, True)
        return
    console().print(_grid(data))
    # The key on a line of its own, for copying; never wrapped by rich.
    sys.stdout.write(f"\n{data['key']}\n\nThis key will not be shown again: store it now "
                     "(the gateway keeps only its hash).\n")


def _fields(rec: dict[str, Any]) -> list[tuple[str, str]]:
    return [("id", rec["id"]), ("name", rec["name"]), ("prefix", rec.get("prefix") or "?"),
            ("models", _models(rec)), ("limits", _limits(rec)), ("expires", _expiry(rec)),
            ("created", when(rec["created"]))]


def _grid(rec: dict[str, Any]) -> Table:
    grid = Table.grid(padding=(0, 2))
    for label, value in _fields(rec):
        grid.add_row(label, Text(value))  # Text: a name is shown as given, never as markup
    return grid


@app.command("list")
def list_keys(gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Every key: prefix, models, limits, expiry (never the key)."""
    data = request(gateway, "GET", "/admin/keys")
    # Ids and prefixes whole on narrow terminals, to copy: the others wrap.
    table = Table(*(Column(c.upper(), no_wrap=c in ("id", "prefix")) for c in (
        "id", "name", "prefix", "models", "limits", "expires", "created")))
    for rec in sorted(data, key=lambda r: r.get("created", 0)):
        row = [value for _, value in _fields(rec)]
        row[-1] = row[-1][:10]  # the day (--json has the time): rows fit 100 columns
        table.add_row(*map(Text, row))
    out(data, as_json, table)


@app.command()
def show(key_id: KeyId, gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """One key: prefix, models, limits, expiry (never the key)."""
    data = request(gateway, "GET", _path(key_id))
    out(data, as_json, _grid(data))


@app.command()
def revoke(key_id: KeyId, gateway: Gateway = DEFAULT_GATEWAY) -> None:
    """Revoke a key: every gateway refuses it within a second; its usage stays."""
    request(gateway, "DELETE", _path(key_id))  # 204, no body
    sys.stdout.write(f"key {key_id} revoked\n")


@app.command()
def usage(key_id: KeyId, gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Requests and tokens per model, every gateway's counts together."""
    data = request(gateway, "GET", _path(key_id, "/usage"))
    if as_json:
        out(data, True)
        return
    title = f"key {key_id} ({data.get('name') or 'revoked'})"
    table = Table("MODEL", *(Column(c, justify="right") for c in (
        "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS", "ESTIMATED")), title=title)
    counts = ("requests", "prompt_tokens", "completion_tokens", "estimated")
    for model_name, u in sorted(data.get("models", {}).items()):
        table.add_row(Text(model_name), *(str(u.get(f, 0)) for f in counts))
    table.add_section()
    table.add_row("TOTAL", *(str(data.get("total", {}).get(f, 0)) for f in counts))
    console().print(table)
    # Each gateway writes its counts every LLMGW_KEY_USAGE_INTERVAL seconds
    # (app/control/key_usage.py): say how fresh they are.
    now = time.time()
    wrote = data.get("gateways", {})
    for gw_id, updated in sorted(wrote.items()):
        sys.stdout.write(f"{gw_id} last wrote {when(updated, seconds=True)} "
                         f"({max(0, now - updated):.0f} s ago)\n")
    if data.get("total", {}).get("estimated"):
        sys.stdout.write("ESTIMATED: requests whose tokens are estimates (streams that ended "
                         "before the engine reported their usage)\n")
    sys.stdout.write("requests of the last LLMGW_KEY_USAGE_INTERVAL seconds may be missing\n"
                     if wrote else "no gateway has written usage for this key yet (they write "
                     "every LLMGW_KEY_USAGE_INTERVAL seconds)\n")
