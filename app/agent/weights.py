"""The node's model cache: what it holds, and removing entries from it.

The cache is the folder engines download hub weights into (Hugging Face's
layout: `models--ORG--NAME/{blobs,snapshots,refs}`). An admin frees disk by
naming entries to remove; every path is checked before anything is removed
(all or nothing):

- it must lie strictly inside the cache: `..` is refused outright, and the
  path is resolved (every symlink in its folders followed) before it is
  compared, so neither an absolute path elsewhere nor a link in the cache
  pointing out of it reaches anything outside; a symlink named itself must
  point inside the cache too;
- it must not hold, or lie inside, the weights of a replica this node runs
  (or is assigned): removing them would break the engine's next load.

Not guaranteed: a replica assigned between the check and the removal may
start downloading what is being removed (vLLM then downloads it again).
Everything here blocks (walks, rmtree): run it in a thread.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any


def default_cache_dir() -> Path:
    """Where vLLM (through huggingface_hub) downloads, by the same rules:
    HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(home).expanduser() / "hub"


class Refused(Exception):
    """A path that may not be removed: `status` is the HTTP answer (400:
    outside the cache or malformed, 404: not there, 409: in use)."""

    def __init__(self, status: int, path: str, reason: str) -> None:
        super().__init__(f"{path!r}: {reason}")
        self.status = status
        self.path = path
        self.reason = reason


@dataclass
class Entry:
    path: str  # relative to the cache
    size: int  # bytes, each file counted once
    last_used: float  # latest access or change of any file in it (Unix time)
    model: str = ""  # the hub id a `models--ORG--NAME` folder holds
    in_use_by: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def hub_folder(weights: str) -> str | None:
    """The cache folder of a hub id ("org/name" -> "models--org--name"),
    None for a file path."""
    if weights.startswith("/"):
        return None
    return "models--" + weights.replace("/", "--")


def in_use_paths(cache: Path, weights: Mapping[str, list[str]]) -> dict[Path, list[str]]:
    """Resolved paths each replica's weights occupy -> replica ids, from
    {weights: [replica ids]}: a hub id's cache folder, or the path itself."""
    out: dict[Path, list[str]] = {}
    for w, replicas in weights.items():
        folder = hub_folder(w)
        where = cache / folder if folder is not None else Path(w)
        out.setdefault(Path(os.path.realpath(where)), []).extend(replicas)
    return out


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def _measure(root: Path) -> tuple[int, float]:
    """Size and last use of a folder or file, never following symlinks."""
    seen: set[tuple[int, int]] = set()
    size, last = 0, 0.0
    try:
        top = root.lstat()
    except OSError:
        return 0, 0.0
    stats = [top]
    if stat.S_ISDIR(top.st_mode):
        for folder, _dirs, files in os.walk(root):
            for name in files:
                try:
                    stats.append(os.lstat(os.path.join(folder, name)))
                except OSError:
                    continue
    for st in stats:
        last = max(last, st.st_atime, st.st_mtime)
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            size += st.st_size
    return size, last


def listing(cache: Path, in_use: Mapping[Path, list[str]]) -> list[Entry]:
    """The cache's top-level entries (hidden ones, like `.locks`, left out)."""
    try:
        names = sorted(n for n in os.listdir(cache) if not n.startswith("."))
    except FileNotFoundError:
        return []
    real = Path(os.path.realpath(cache))
    out = []
    for name in names:
        size, last = _measure(cache / name)
        model = name[len("models--"):].replace("--", "/") if name.startswith("models--") else ""
        users = sorted({r for p, rs in in_use.items() if _overlaps(p, real / name) for r in rs})
        out.append(Entry(path=name, size=size, last_used=last, model=model, in_use_by=users))
    return out


def check(cache: Path, raw: str, in_use: Mapping[Path, list[str]]) -> Path:
    """The path `raw` names (relative to the cache, or absolute), if it may
    be removed; raises Refused naming it otherwise."""
    if not raw or "\x00" in raw:
        raise Refused(400, raw, "not a path")
    if ".." in PurePosixPath(raw).parts:
        raise Refused(400, raw, "'..' is not allowed: name a path inside the cache")
    real_cache = Path(os.path.realpath(cache))
    given = Path(raw) if raw.startswith("/") else cache / raw
    # Folders resolved, the last part kept: a symlink named is the link itself.
    target = Path(os.path.realpath(given.parent)) / given.name
    if target == real_cache or not target.is_relative_to(real_cache):
        raise Refused(400, raw, f"not inside the cache directory {cache}")
    if not os.path.lexists(target):
        raise Refused(404, raw, "no such file or folder in the cache")
    if target.is_symlink():
        points = Path(os.path.realpath(target))
        if not points.is_relative_to(real_cache):
            raise Refused(400, raw, f"a symlink to {points}, outside the cache directory")
    for path, replicas in in_use.items():
        if _overlaps(target, path) or _overlaps(Path(os.path.realpath(target)), path):
            raise Refused(409, raw, "holds the weights of replica "
                          f"{', '.join(sorted(replicas))}, which this node runs")
    return target


def remove(cache: Path, paths: Iterable[str], in_use: Mapping[Path, list[str]]) -> list[str]:
    """Removes every path, or none if any is refused (Refused raised)."""
    raws = list(paths)
    targets = [check(cache, raw, in_use) for raw in raws]
    for target in targets:
        if not os.path.lexists(target):
            continue  # inside another path of the same request, already removed
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)  # removes links inside, never what they point to
        else:
            target.unlink(missing_ok=True)
    return raws
