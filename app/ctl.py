"""`llmgw ctl`: the operator's commands, over a gateway's /admin API.

The gateway comes from `--gateway` or LLMGW_GATEWAY (default
http://127.0.0.1:8080), the admin token from LLMGW_ADMIN_TOKEN (else the
all-in-one data directory's `admin-token` file). Tables for people;
`--json` prints the gateway's answer as it is, for scripts. A failure is
one line on stderr ("llmgw ctl: ...") and exit status 1; a usage error 2.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from app.control.keys import node_token
from app.control.state import check_name

# No locals in tracebacks: they would print the admin token.
app = typer.Typer(name="llmgw ctl", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False,
                  help="Operator commands, over a gateway's admin API.")

_TIMEOUT = 60.0  # the gateway waits up to LLMGW_NODE_API_TIMEOUT (30 s) on an agent

Gateway = Annotated[str, typer.Option(
    "--gateway", envvar="LLMGW_GATEWAY", help="a gateway's URL (LLMGW_GATEWAY)")]
AsJson = Annotated[bool, typer.Option("--json", help="print the gateway's JSON answer")]
_DEFAULT_GATEWAY = "http://127.0.0.1:8080"


def fail(message: str) -> NoReturn:
    """A failure: one line on stderr, exit status 1."""
    sys.stderr.write(f"llmgw ctl: {message}\n")
    raise typer.Exit(1)


def _data_dir_file(name: str) -> str:
    data_dir = Path(os.environ.get("LLMGW_DATA_DIR", "~/.local/share/llmgw")).expanduser()
    path = data_dir / name
    return path.read_text().strip() if path.exists() else ""


def _admin_token() -> str:
    token = os.environ.get("LLMGW_ADMIN_TOKEN", "") or _data_dir_file("admin-token")
    if not token:
        fail("set LLMGW_ADMIN_TOKEN (the gateways' admin token)")
    return token


def request(gateway: str, method: str, path: str, body: Any = None,
            params: dict[str, str] | None = None, timeout: float = _TIMEOUT) -> Any:
    """One admin API call; fails with the gateway's problem detail."""
    url = gateway.rstrip("/") + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {_admin_token()}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            problem = json.loads(raw)
        except ValueError:
            problem = None
        if isinstance(problem, dict):
            said = problem.get("title", "")
            if problem.get("detail"):
                said = f"{said}: {problem['detail']}" if said else str(problem["detail"])
        else:
            said = raw.decode(errors="replace").strip()[:200]
        if exc.code == 401:
            said += " (check LLMGW_ADMIN_TOKEN)"
        fail(f"{gateway} answered {exc.code}: {said}")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        fail(f"cannot reach the gateway at {gateway}: {reason}")


def _out(data: Any, as_json: bool, table: Table | None = None) -> None:
    if as_json or table is None:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        Console(highlight=False).print(table)


def _gib(mib: float) -> str:
    return f"{mib / 1024:.0f} GiB"


def _gpus(node: dict[str, Any]) -> str:
    gpus = node.get("gpus") or []
    if not gpus:
        return "none"
    names = Counter(g.get("name") or "GPU" for g in gpus)
    text = ", ".join(f"{n}x {name}" for name, n in sorted(names.items()))
    free = [g.get("memory_free_mib") for g in gpus]
    total = sum(g.get("memory_mib") or 0 for g in gpus)
    if total and all(f is not None for f in free):
        text += f" ({_gib(sum(f for f in free if f is not None))} of {_gib(total)} free)"
    return text


@app.command()
def nodes(gateway: Gateway = _DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Nodes: GPUs, versions, host and replicas."""
    data = request(gateway, "GET", "/admin/nodes")
    table = Table("NODE", "ADDRESS", "GPUS", "VERSIONS", "HOST", "REPLICAS")
    for n in data:
        versions = f"llmgw {n.get('version') or '?'}"
        if n.get("driver_version"):
            versions += f", driver {n['driver_version']}"
        if n.get("cuda_version"):
            versions += f", CUDA {n['cuda_version']}"
        if n.get("vllm_build") is not None:  # agents older than engine builds: absent
            versions += f", vLLM build {n['vllm_build'] or 'none usable'}"
        host = f"{n.get('cpus') or '?'} CPUs, {_gib(n.get('memory_mib') or 0)}"
        table.add_row(n["name"], n.get("address", ""), _gpus(n), versions, host,
                      ", ".join(n.get("replicas", [])))
    _out(data, as_json, table)


@app.command()
def models(gateway: Gateway = _DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Models in the catalog and how their replicas stand."""
    data = request(gateway, "GET", "/admin/models")
    table = Table("MODEL", "WEIGHTS", "ENGINE", "GPUS", "READY", "ALIASES", "PROBLEM")
    for m in data:
        st = m.get("status", {})
        problem = st.get("unplaced") or "; ".join(
            f"{f['id']} failed" for f in st.get("failed", [])) or ""
        # A spec is stored as given: flat engine/gpus, profiles, or external.
        first = (m.get("profiles") or [{}])[0]
        engine = m.get("engine") or first.get("engine") or (
            "external" if m.get("external") else "vllm")
        gpus = m.get("gpus", first.get("gpus"))
        weights = m.get("model") or (m.get("external") or {}).get("url", "")
        table.add_row(m["name"], weights, engine, "" if gpus is None else str(gpus),
                      f"{st.get('ready', 0)}/{st.get('wanted', 0)}",
                      ", ".join(m.get("aliases", [])), problem)
    _out(data, as_json, table)


@app.command()
def replicas(gateway: Gateway = _DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Replicas: model, node, GPUs, phase, URL."""
    data = request(gateway, "GET", "/admin/replicas")
    table = Table("REPLICA", "MODEL", "NODE", "GPUS", "PHASE", "URL", "DETAIL")
    for rep in data:
        detail = (rep.get("detail") or "").splitlines()
        table.add_row(rep["id"], rep["model"], rep["node"],
                      ",".join(str(g) for g in rep.get("gpus", [])), rep.get("phase", ""),
                      rep.get("url", ""), detail[0] if detail else "")
    _out(data, as_json, table)


@app.command()
def logs(
    node: Annotated[str, typer.Argument(help="node name")],
    source: Annotated[str, typer.Option("--source", "-s",
                                        help="'agent' or a replica id")] = "agent",
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, max=10_000)] = 100,
    gateway: Gateway = _DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """Recent lines of a node's log: its agent's, or a replica's engine."""
    data = request(gateway, "GET", f"/admin/nodes/{urllib.parse.quote(node)}/logs",
                   params={"source": source, "lines": str(lines)})
    if as_json:
        _out(data, True)
        return
    sys.stdout.write("".join(f"{line}\n" for line in data.get("lines", [])))
    sys.stderr.write(f"({node}: sources {', '.join(data.get('sources', []))})\n")


@app.command()
def weights(
    node: Annotated[str, typer.Argument(help="node name")],
    paths: Annotated[list[str] | None, typer.Argument(
        help="with --delete: entries to remove (relative to the cache, or inside it)")] = None,
    delete: Annotated[bool, typer.Option("--delete", help="remove PATHS (all or none)")] = False,
    gateway: Gateway = _DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """A node's model cache; with --delete PATH..., removes entries."""
    where = f"/admin/nodes/{urllib.parse.quote(node)}/weights"
    if paths and not delete:
        raise typer.BadParameter("paths given without --delete", param_hint="PATHS")
    if delete:
        if not paths:
            raise typer.BadParameter("--delete needs at least one path", param_hint="PATHS")
        data = request(gateway, "DELETE", where, body={"paths": paths})
        if as_json:
            _out(data, True)
        else:
            for p in data.get("removed", []):
                sys.stdout.write(f"removed {p}\n")
        return
    data = request(gateway, "GET", where)
    table = Table("PATH", "MODEL", "SIZE", "LAST USED", "IN USE BY",
                  title=f"{node}: {data.get('cache_dir', '')}")
    for e in data.get("entries", []):
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"]))
        table.add_row(e["path"], e.get("model", ""), f"{e['size'] / 2**30:.2f} GiB", used,
                      ", ".join(e.get("in_use_by", [])))
    _out(data, as_json, table)


@app.command("fabric-test")
def fabric_test(
    nodes: Annotated[list[str], typer.Argument(help="two or more node names")],
    seconds: Annotated[float, typer.Option("--seconds", min=0.1, max=2.0,
                                           help="per direction")] = 1.0,
    gateway: Gateway = _DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """TCP bandwidth between nodes' agents, every pair both ways (kept for placement)."""
    if len(nodes) < 2:
        raise typer.BadParameter("name two or more nodes", param_hint="NODES")
    # Directions run one at a time, each up to `seconds` plus the agents' calls.
    pairs = len(nodes) * (len(nodes) - 1)
    data = request(gateway, "POST", "/admin/fabric-test",
                   body={"nodes": nodes, "seconds": seconds},
                   timeout=_TIMEOUT + pairs * (seconds + 10))
    table = Table("FROM", "TO", "GB/S", "BYTES", "SECONDS")
    for res in data.get("results", []):
        table.add_row(res["from"], res["to"], f"{res['gbps']:.2f}", str(res["bytes"]),
                      f"{res['seconds']:.3f}")
    _out(data, as_json, table)
    if not data.get("saved", True):
        sys.stderr.write("(results not saved: the store is unreachable)\n")


@app.command()
def upgrade(
    node: Annotated[str, typer.Argument(help="node name")],
    version: Annotated[str, typer.Argument(help="llmgw version to install, e.g. 0.2.0")],
    index_url: Annotated[str | None, typer.Option(
        "--index-url", help="package index (default: the agent's installer's)")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=1, help="seconds to wait for the install")] = 360.0,
    gateway: Gateway = _DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """Install an llmgw version on a node's agent; it restarts on it, keeping its engines."""
    data = request(gateway, "POST", f"/admin/nodes/{urllib.parse.quote(node)}/upgrade",
                   body={"version": version, "index_url": index_url}, timeout=timeout)
    if as_json:
        _out(data, True)
        return
    sys.stdout.write(f"{node}: llmgw {data.get('from', '?')} -> {data.get('version', version)} "
                     "installed; the agent is restarting and keeps its engines\n")


@app.command("engine-build")
def engine_build(
    node: Annotated[str, typer.Argument(help="node name")],
    choice: Annotated[str, typer.Argument(help="auto, cu13, cu129 or none")],
    gateway: Gateway = _DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """Choose the vLLM build a node's agent installs (none: no vLLM replicas there)."""
    if choice not in ("auto", "cu13", "cu129", "none"):
        raise typer.BadParameter("one of auto, cu13, cu129, none", param_hint="CHOICE")
    data = request(gateway, "PUT", f"/admin/nodes/{urllib.parse.quote(node)}/engine-build",
                   body={"build": choice})
    if as_json:
        _out(data, True)
    else:
        sys.stdout.write(f"{node}: engine build {data.get('engine_build', choice)}\n")


@app.command("node-token")
def node_token_cmd(node: Annotated[str, typer.Argument(help="node name")]) -> None:
    """Print the agent token (LLMGW_AGENT_TOKEN) for a node, derived from LLMGW_SECRET."""
    try:
        check_name(node, "node name")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="NODE") from None
    secret = os.environ.get("LLMGW_SECRET", "") or _data_dir_file("secret")
    if not secret:
        fail("set LLMGW_SECRET")
    sys.stdout.write(node_token(secret, node) + "\n")


def run(argv: list[str]) -> None:
    """Runs `llmgw ctl ARGV` and exits with its status."""
    app(args=argv, prog_name="llmgw ctl")
