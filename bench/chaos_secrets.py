"""The secrets grep bench/chaos.py runs after its schedules: every secret
the fleet holds (the shared secret, the admin token, each engine key derived
as the gateways derive it, each node token, every client key the admin was
given, the provider key) looked for in everything the run captured: every
file the processes wrote under the run's directory (their logs, stdout and
stderr, the engines' logs, etcd's data, the gateways' data dirs), every
answer the clients and the admin got, every command line of the run's
processes (read from /proc while they ran) and every etcd value, at the end
and in its history. Any hit is a finding naming where (docs/design/security.md:
secrets never appear in logs, responses or etcd in clear).

Seen to fail: a node token planted in a captured log and an engine key in a
command line are both reported (tests/test_chaos.py,
test_secrets_grep_flags_a_planted_secret). Broken llmgw: the agent logging
each engine's key as it starts it (app/agent/engines.py): 6 findings in a
one-fault run, e.g. "replica chat-cc777b39's engine key in file
agent-node-1/agent.log" (and in the agent's stdout, agent-node-1.log).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from chaos_checks import Call, Event

# Files that hold a secret by design: the provider key's own file.
KEY_DIR = "keys"


def find(secrets: dict[str, str], places: Iterable[tuple[str, bytes]]) -> list[str]:
    """`name in where` for each secret found in each place (one pass over
    each place, however many secrets)."""
    names = {v.encode(): name for name, v in sorted(secrets.items()) if v}
    if not names:
        return []
    # Longest first: a secret that holds another is named, not the shorter.
    pattern = re.compile(b"|".join(re.escape(v) for v in sorted(names, key=len, reverse=True)))
    out = []
    for where, data in places:
        hits = {names[m.group(0)] for m in pattern.finditer(data)}
        out += [f"{name} in {where}" for name in sorted(hits)]
    return out


def secrets_of(secret: str, admin: str, provider: str, nodes: Iterable[str],
               replica_ids: Iterable[str], client_keys: Iterable[str]) -> dict[str, str]:
    from app.control.keys import engine_key
    from app.wire.tokens import node_token

    out = {"the shared secret": secret, "the admin token": admin, "the provider key": provider}
    out |= {f"node {n}'s token": node_token(secret, n) for n in nodes}
    out |= {f"replica {r}'s engine key": engine_key(secret, r) for r in replica_ids}
    out |= {f"client key {i}": k for i, k in enumerate(client_keys)}
    return out


def files(root: Path) -> Iterator[tuple[str, bytes]]:
    """Every file under the run's directory, the provider key's dir aside."""
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root)
        if rel.parts[0] == KEY_DIR or not f.is_file():
            continue
        with contextlib.suppress(OSError):
            yield f"file {rel}", f.read_bytes()


def answers(calls: Iterable[Call], admin: Iterable[tuple[str, str]]) -> Iterator[
        tuple[str, bytes]]:
    for c in calls:
        yield f"the answer to client call {c.id}", f"{c.body}\n{c.reason}\n{c.error}".encode()
    for i, (what, body) in enumerate(admin):
        yield f"admin answer {i} ({what})", body.encode()


def etcd_values(history: Iterable[Event], final: dict[str, Any]) -> Iterator[tuple[str, bytes]]:
    for e in history:
        yield f"etcd's history at revision {e.rev} ({e.key})", f"{e.key}\n{e.raw}".encode()
    for key, value in final.items():
        yield f"etcd's value of {key} at the end", f"{key}\n{value!r}".encode()


class Cmdlines:
    """Samples the command lines of the run's processes (found by `tag` in
    their environment) every `every` s while it runs, engines included."""

    def __init__(self, tag: str, every: float = 1.0) -> None:
        self.tag, self.every = tag.encode(), every
        self.seen: dict[bytes, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Cmdlines:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self) -> None:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if self.tag not in (proc / "environ").read_bytes().split(b"\0"):
                    continue
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            self.seen.setdefault(cmd, proc.name)

    def places(self) -> Iterator[tuple[str, bytes]]:
        for cmd, pid in list(self.seen.items()):
            shown = cmd.replace(b"\0", b" ")[:80].decode(errors="replace")
            yield f"the command line of pid {pid} ({shown})", cmd

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()
