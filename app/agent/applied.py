"""Which assignments an agent has applied, kept across its restarts.

A gateway whose mirror lags answers assignments older than the last ones
applied; taking them would stop an engine the newer list still has (a GPU
model reload of minutes) or start one already deleted. Each answer carries
the store revision it was read at and the store's id (app/control/
storeid.py); revisions compare only within one store, since a new store
counts from 1 again. The pair is kept in WORK_DIR/assignments.json, so a
restarted agent whose first answer comes from a lagging gateway ignores it
too (docs/design/agent.md, "Agent restarts").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.agent.engines import write_json

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Applied:
    """The store id and revision of the last assignments applied. `store`
    is "" for an answer from a gateway older than store ids."""

    store: str = ""
    revision: int = 0


def older_than(answer: Applied, kept: Applied, in_run: int) -> int | None:
    """The revision applied that an answer is older than, None if it is not.
    With a store id: the one kept, from that same store (another store's
    revisions mean nothing here: the store was replaced). Without one (a
    gateway older than store ids): the last answer applied in this run."""
    if answer.store:
        same = answer.store == kept.store and answer.revision < kept.revision
        return kept.revision if same else None
    return in_run if answer.revision < in_run else None


def load(path: Path) -> Applied:
    """What an earlier run kept; nothing (compare nothing) when there is no
    file or it cannot be read."""
    try:
        raw = json.loads(path.read_text())
        return Applied(store=str(raw["store"]), revision=int(raw["revision"]))
    except FileNotFoundError:
        return Applied()
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return Applied()


def save(path: Path, applied: Applied) -> None:
    """Written whole or not at all: a crash mid-write leaves the old file."""
    try:
        write_json(path, {"store": applied.store, "revision": applied.revision})
    except OSError as exc:
        # Still compared in this run; only a restart would forget it.
        logger.warning("could not keep the applied revision in %s: %s", path, exc)


class Kept:
    """The agent's record: what it applied in this run and, from the store
    ids it was told, across runs (kept in `path`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kept = load(path)
        self.in_run = 0

    def older_than(self, answer: dict[str, Any]) -> tuple[Applied, int | None]:
        """The answer's (store, revision), and the revision applied that it
        is older than (None: take it). Missing from gateways older than this
        agent: "" and 0."""
        got = Applied(str(answer.get("store") or ""), int(answer.get("revision") or 0))
        return got, older_than(got, self.kept, self.in_run)

    def take(self, got: Applied) -> None:
        self.in_run = got.revision
        if got.store and got != self.kept:
            self.kept = got
            save(self.path, got)
