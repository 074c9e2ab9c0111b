"""`llmgw ctl catalog apply --wait`: polls GET /admin/models until every
model applied has the replicas it wants ready, showing each one's progress
(rich, on stderr), or fails at the timeout naming the models not ready and
why, from their status: not placed (placement's reasons per node), failed
replicas, or still loading."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from app.ctl.common import fail, request

POLL = 1.0  # seconds between two reads of GET /admin/models


@dataclass(frozen=True)
class Standing:
    ready: bool
    have: int
    want: int
    why: str  # "" when ready

    def line(self, name: str) -> str:
        if self.ready:
            return f"{name}: ready ({self.have}/{self.want})"
        return f"{name} ({self.have}/{self.want}): {self.why}"


def standing(item: Mapping[str, Any] | None, applied: Mapping[str, Any]) -> Standing:
    """How one model stands, from its GET /admin/models entry (None: not
    listed), against the spec just applied (a gateway whose mirror has not
    seen the write yet still shows the old one)."""
    if item is None:
        return Standing(False, 0, 0, "not in the gateway's catalog yet")
    spec = {k: v for k, v in item.items() if k not in ("name", "created", "status", "etag")}
    st = item.get("status") or {}
    have, want = int(st.get("ready") or 0), int(st.get("wanted") or 0)
    if spec != applied:
        return Standing(False, have, want, "the gateway has not seen this spec yet")
    if have >= want:
        return Standing(True, have, want, "")
    reasons = []
    if st.get("unplaced"):
        reasons.append(f"not placed: {st['unplaced']}")
    failed = [f"{f.get('id')} on {f.get('node')}: {f.get('detail') or 'failed'}"
              for f in st.get("failed") or []]
    if failed:
        reasons.append(f"failed: {'; '.join(failed)}")
    if not reasons:
        placed = int(st.get("replicas") or 0)
        reasons.append(f"{placed} placed, {placed - have} starting" if placed
                       else "waiting for placement")
    return Standing(False, have, want, " ".join("; ".join(reasons).split()))


def wait_ready(gateway: str, applied: Mapping[str, Any], timeout: float,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """Returns once every model of `applied` (name -> spec as put) is ready;
    fails (exit 1) at `timeout` seconds naming the others and why."""
    started = clock()
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed:.0f}/{task.total:.0f} ready"),
                  TextColumn("{task.fields[why]}"), console=console,
                  transient=True) as progress:
        tasks = {name: progress.add_task(name, total=1, why="") for name in applied}
        while True:
            listed = {str(m.get("name")): m for m in request(gateway, "GET", "/admin/models")}
            now = {name: standing(listed.get(name), spec) for name, spec in applied.items()}
            for name, st in now.items():
                progress.update(tasks[name], completed=st.have, total=max(st.want, 1),
                                why=st.why)
            waiting = [name for name, st in now.items() if not st.ready]
            if not waiting:
                break
            if clock() - started >= timeout:
                progress.stop()
                fail(f"not ready after {timeout:g} s: "
                     + " | ".join(now[name].line(name) for name in waiting))
            sleep(POLL)
    for name, st in now.items():
        sys.stdout.write(st.line(name) + "\n")
