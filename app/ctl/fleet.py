"""The fleet's commands: nodes, models, replicas, a node's logs, weights,
upgrade and engine build, fabric tests, node tokens. Registered on
`llmgw ctl` by app/ctl/__init__.py."""

from __future__ import annotations

import os
import sys
import urllib.parse
from collections import Counter
from typing import Annotated, Any

import typer
from rich.table import Table

from app.ctl.common import (
    DEFAULT_GATEWAY,
    TIMEOUT,
    AsJson,
    Gateway,
    data_dir_file,
    fail,
    out,
    request,
    when,
)
from app.wire.names import check_name
from app.wire.tokens import node_token

# The engines as people name them (app/wire/names.py's Engine).
_ENGINES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}


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
    # Kept out of placement until `llmgw ctl node gpu-clear NODE INDEX`.
    for g in gpus:
        if g.get("unhealthy"):
            text += f"; GPU {g.get('index')} UNHEALTHY: {g.get('health_reason') or '?'}"
    return text


def _state(conf: dict[str, Any]) -> str:
    """The operator's choices for a node, in a few words."""
    words = ["draining" if conf.get("draining") else
             "cordoned" if conf.get("cordoned") else "schedulable"]
    if conf.get("pool", "default") != "default":
        words.append(f"pool {conf['pool']}")
    words += [f"{k}={v}" for k, v in sorted((conf.get("labels") or {}).items())]
    return ", ".join(words)


def nodes(gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Nodes: GPUs, versions, host and replicas."""
    data = request(gateway, "GET", "/admin/nodes")
    table = Table("NODE", "ADDRESS", "GPUS", "FREE", "VERSIONS", "HOST", "STATE", "REPLICAS")
    for n in data:
        versions = f"llmgw {n.get('version') or '?'}"
        if n.get("driver_version"):
            versions += f", driver {n['driver_version']}"
        if n.get("cuda_version"):
            versions += f", CUDA {n['cuda_version']}"
        # The vLLM build where the node runs vLLM (a CPU node without it has
        # none to tell of), then its other engines.
        engines = n.get("engines")
        engines = engines if isinstance(engines, list) else None
        if n.get("vllm_build") is not None and (engines is None or "vllm" in engines):
            versions += f", vLLM build {n['vllm_build'] or 'none usable'}"
            if n.get("vllm_version"):
                versions += f" (vllm {n['vllm_version']})"
        if engines is not None:
            versions += "".join(f", {_ENGINES.get(e, str(e))}" for e in engines if e != "vllm")
            if not engines:
                versions += ", no engine"
        host = f"{n.get('cpus') or '?'} CPUs, {_gib(n.get('memory_mib') or 0)}"
        # Free of total GPUs: those no replica holds (gateways older than
        # this do not say: "?").
        free = n.get("gpus_free")
        table.add_row(n["name"], n.get("address", ""), _gpus(n),
                      f"{'?' if free is None else free}/{len(n.get('gpus') or [])}",
                      versions, host,
                      _state(n.get("conf") or {}), ", ".join(n.get("replicas", [])))
    out(data, as_json, table)


def models(gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
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
    out(data, as_json, table)


def replicas(gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False) -> None:
    """Replicas: model, node, GPUs, phase, URL."""
    data = request(gateway, "GET", "/admin/replicas")
    table = Table("REPLICA", "MODEL", "NODE", "GPUS", "PHASE", "URL", "DETAIL")
    for rep in data:
        detail = (rep.get("detail") or "").splitlines()
        table.add_row(rep["id"], rep["model"], rep["node"],
                      ",".join(str(g) for g in rep.get("gpus", [])), rep.get("phase", ""),
                      rep.get("url", ""), detail[0] if detail else "")
    out(data, as_json, table)


def logs(
    node: Annotated[str, typer.Argument(help="node name")],
    source: Annotated[str, typer.Option("--source", "-s",
                                        help="'agent' or a replica id")] = "agent",
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, max=10_000)] = 100,
    gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """Recent lines of a node's log: its agent's, or a replica's engine."""
    data = request(gateway, "GET", f"/admin/nodes/{urllib.parse.quote(node)}/logs",
                   params={"source": source, "lines": str(lines)})
    if as_json:
        out(data, True)
        return
    sys.stdout.write("".join(f"{line}\n" for line in data.get("lines", [])))
    sys.stderr.write(f"({node}: sources {', '.join(data.get('sources', []))})\n")


def weights(
    node: Annotated[str, typer.Argument(help="node name")],
    paths: Annotated[list[str] | None, typer.Argument(
        help="with --delete: entries to remove (relative to the cache, or inside it)")] = None,
    delete: Annotated[bool, typer.Option("--delete", help="remove PATHS (all or none)")] = False,
    gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False,
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
            out(data, True)
        else:
            for p in data.get("removed", []):
                sys.stdout.write(f"removed {p}\n")
        return
    data = request(gateway, "GET", where)
    table = Table("PATH", "MODEL", "SIZE", "LAST USED", "IN USE BY",
                  title=f"{node}: {data.get('cache_dir', '')}")
    for e in data.get("entries", []):
        used = when(e["last_used"])
        table.add_row(e["path"], e.get("model", ""), f"{e['size'] / 2**30:.2f} GiB", used,
                      ", ".join(e.get("in_use_by", [])))
    out(data, as_json, table)


def fabric_test(
    nodes: Annotated[list[str], typer.Argument(help="two or more node names")],
    seconds: Annotated[float, typer.Option("--seconds", min=0.1, max=2.0,
                                           help="per direction")] = 1.0,
    gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """TCP bandwidth between nodes' agents, every pair both ways (kept for placement)."""
    if len(nodes) < 2:
        raise typer.BadParameter("name two or more nodes", param_hint="NODES")
    # Directions run one at a time, each up to `seconds` plus the agents' calls.
    pairs = len(nodes) * (len(nodes) - 1)
    data = request(gateway, "POST", "/admin/fabric-test",
                   body={"nodes": nodes, "seconds": seconds},
                   timeout=TIMEOUT + pairs * (seconds + 10))
    table = Table("FROM", "TO", "GB/S", "BYTES", "SECONDS")
    for res in data.get("results", []):
        table.add_row(res["from"], res["to"], f"{res['gbps']:.2f}", str(res["bytes"]),
                      f"{res['seconds']:.3f}")
    out(data, as_json, table)
    if not data.get("saved", True):
        sys.stderr.write("(results not saved: the store is unreachable)\n")


def upgrade(
    node: Annotated[str, typer.Argument(help="node name")],
    version: Annotated[str, typer.Argument(help="llmgw version to install, e.g. 0.2.0")],
    sha256: Annotated[str, typer.Option(
        "--sha256", help="the wheel's sha256 (`sha256sum llmgw-X-py3-none-any.whl`): the "
        "agent installs that file only, from its node's configured source")],
    timeout: Annotated[float, typer.Option(
        "--timeout", min=1, help="seconds to wait for the install")] = 360.0,
    gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """Install an llmgw version on a node's agent; it restarts on it, keeping its engines."""
    data = request(gateway, "POST", f"/admin/nodes/{urllib.parse.quote(node)}/upgrade",
                   body={"version": version, "sha256": sha256}, timeout=timeout)
    if as_json:
        out(data, True)
        return
    sys.stdout.write(f"{node}: llmgw {data.get('from', '?')} -> {data.get('version', version)} "
                     "installed; the agent is restarting and keeps its engines\n")


def engine_build(
    node: Annotated[str, typer.Argument(help="node name")],
    choice: Annotated[str, typer.Argument(help="auto, cu13, cu129, cpu (vLLM's CPU build) "
                                                 "or none")],
    vllm_version: Annotated[str, typer.Option(
        "--vllm-version", help="vLLM version to install (default: the gateways' "
        "LLMGW_VLLM_VERSION, or LLMGW_VLLM_CPU_VERSION for cpu)")] = "",
    gateway: Gateway = DEFAULT_GATEWAY, as_json: AsJson = False,
) -> None:
    """Choose the vLLM build a node's agent installs (none: no vLLM replicas there)."""
    if choice not in ("auto", "cu13", "cu129", "cpu", "none"):
        raise typer.BadParameter("one of auto, cu13, cu129, cpu, none", param_hint="CHOICE")
    data = request(gateway, "PUT", f"/admin/nodes/{urllib.parse.quote(node)}/engine-build",
                   body={"build": choice, "vllm_version": vllm_version})
    if as_json:
        out(data, True)
    else:
        pinned = data.get("vllm_version") or "the gateways' default"
        sys.stdout.write(f"{node}: engine build {data.get('engine_build', choice)}, "
                         f"vLLM {pinned}\n")


def node_token_cmd(node: Annotated[str, typer.Argument(help="node name")]) -> None:
    """Print the agent token (LLMGW_AGENT_TOKEN) for a node, derived from LLMGW_SECRET."""
    try:
        check_name(node, "node name")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="NODE") from None
    secret = os.environ.get("LLMGW_SECRET", "") or data_dir_file("secret")
    if not secret:
        fail("set LLMGW_SECRET")
    sys.stdout.write(node_token(secret, node) + "\n")

