"""The node's model cache: what it holds, and removing entries from it.

The cache is the folder engines download hub weights into (Hugging Face's
layout: `models--ORG--NAME/{blobs,snapshots,refs}`). An admin frees disk by
naming entries to remove; every path is checked before anything is removed
(all or nothing; a refusal names every replica concerned, once):

- it must lie strictly inside the cache: `..` is refused outright, and the
  path is resolved (every symlink in its folders followed) before it is
  compared, so neither an absolute path elsewhere nor a link in the cache
  pointing out of it reaches anything outside; a symlink named itself must
  point inside the cache too;
- it must not hold, or lie inside, the weights of a replica this node runs
  (or is assigned): removing them would break the engine's next load.
  Weights are reached through symlinks (a hub snapshot's files link into
  its `blobs/`; a weights path may be a link to a snapshot, or a folder of
  links into the cache, or a link to one file of a snapshot), so what is
  protected is the whole chain: each replica's weights resolved, every
  file its links resolve to, and every link on the way (a link to a
  snapshot's file stands on that file, a link itself, and on its folder).

The removal itself never follows a path twice: it opens the cache, then
each folder down to the entry with O_DIRECTORY|O_NOFOLLOW, relative to the
previous one, and removes the entry relative to its parent's descriptor
(`shutil.rmtree(dir_fd=)`, which walks by descriptors too). A folder
swapped for a symlink after the check makes the open fail (nothing
outside the cache is reached); the request answers 409 "changed",
naming the paths it removed before that one (`Refused.removed`), as a
disk error does (`RemovalFailed`).

Not guaranteed: a replica assigned between the check and the removal may
start downloading what is being removed (vLLM then downloads it again).
Everything here blocks (walks, rmtree): run it in a thread.
"""

from __future__ import annotations

import errno
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
    outside the cache or malformed, 404: not there, 409: in use, or changed
    since its check). `removed`: the paths of the same request removed
    before it (none when refused at its check: every path is checked
    before any is removed)."""

    def __init__(self, status: int, path: str, reason: str) -> None:
        super().__init__(f"{path!r}: {reason}")
        self.status = status
        self.path = path
        self.reason = reason
        self.removed: list[str] = []


class RemovalFailed(Exception):
    """A disk error (no permission, I/O) removing `path`, which may be
    partly removed; `removed`: the paths of the same request removed
    before it."""

    def __init__(self, path: str, error: OSError, removed: list[str]) -> None:
        super().__init__(f"{path!r}: {error}")
        self.path = path
        self.error = error
        self.removed = removed


def said_removed(removed: list[str]) -> str:
    """What a request refused or failed midway removed, said."""
    if not removed:
        return "nothing removed"
    return "removed before it: " + ", ".join(repr(p) for p in removed)


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


# Links followed per replica's weights when finding what they point to: a
# model is tens to thousands of files; past this the rest is not protected.
MAX_LINKS = 100_000


# Links followed resolving one path before it counts as a loop (Linux's
# own limit, ELOOP).
_MAX_HOPS = 40


def _follow(path: str, hops: set[Path]) -> Path:
    """`path` (absolute) resolved as os.path.realpath does, a part at a
    time, adding to `hops` each symlink it goes through, named where it
    lies (its folders resolved): realpath says where a chain of links ends,
    not what it stands on. A part that does not exist is taken as written."""
    cur = "/"
    todo = path.split("/")[::-1]
    followed = 0
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            cur = os.path.dirname(cur)  # `cur` is resolved: its parent is
            continue
        nxt = os.path.join(cur, name)
        try:
            target = os.readlink(nxt) if stat.S_ISLNK(os.lstat(nxt).st_mode) else None
        except OSError:
            target = None
        if target is None:
            cur = nxt
            continue
        followed += 1
        hops.add(Path(nxt))
        if followed > _MAX_HOPS:
            return Path(nxt)  # a loop: it ends nowhere further
        if target.startswith("/"):
            cur = "/"
        todo.extend(target.split("/")[::-1])
    return Path(cur)


def _occupied(start: str) -> set[Path]:
    """What weights at `start` stand on: where it resolves to and every link
    on the way; then the same for each symlink under it (a snapshot's files
    into blobs/, a folder of links), walking the folders they lead to as
    well; up to MAX_LINKS links."""
    hops: set[Path] = set()
    ends = {_follow(start, hops)}
    roots = list(ends)
    walked: list[Path] = []
    while roots:
        root = roots.pop()
        if not root.is_dir() or any(root.is_relative_to(w) for w in walked):
            continue
        walked.append(root)
        for folder, dirs, files in os.walk(root):
            for name in (*dirs, *files):
                path = os.path.join(folder, name)
                if not os.path.islink(path):
                    continue
                end = _follow(path, hops)
                ends.add(end)
                roots.append(end)
                if len(hops) >= MAX_LINKS:
                    return ends | hops
    return ends | hops


def in_use_paths(cache: Path, weights: Mapping[str, list[str]]) -> dict[Path, list[str]]:
    """Resolved paths each replica's weights occupy -> replica ids (each
    once), from {weights: [replica ids]}: a hub id's cache folder, or the
    path itself, everything the links inside them lead to (blobs a
    snapshot links to, cache files a folder of links names) and every link
    on the way (a snapshot's links, which a link to one of them stands on)."""
    out: dict[Path, list[str]] = {}
    for w, replicas in weights.items():
        folder = hub_folder(w)
        start = os.path.abspath(cache / folder if folder is not None else Path(w))
        for path in _occupied(start):
            users = out.setdefault(path, [])
            users.extend(r for r in dict.fromkeys(replicas) if r not in users)
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
    real = Path(os.path.realpath(target))
    users = sorted({r for path, replicas in in_use.items()
                    if _overlaps(target, path) or _overlaps(real, path) for r in replicas})
    if users:
        raise Refused(409, raw, f"holds the weights of replica{'s' if len(users) > 1 else ''} "
                      f"{', '.join(users)}, which this node runs")
    return target


_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _remove_at(real_cache: Path, target: Path, raw: str) -> None:
    """Removes `target` (checked: strictly inside `real_cache`, its folders
    resolved) by descriptors: each folder opened without following a link,
    the entry removed relative to its parent's descriptor."""
    parts = target.relative_to(real_cache).parts
    fd = os.open(real_cache, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            except FileNotFoundError:
                return  # inside another path of the same request, already removed
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused(409, raw, f"{part!r} changed into a symlink or a file "
                                  "since it was checked; list the cache again") from None
                raise
            os.close(fd)
            fd = nxt
        try:
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            # Descriptor-based (shutil.rmtree.avoids_symlink_attacks): removes
            # links inside, never what they point to; refuses a folder swapped
            # for a link between its lstat and its open.
            shutil.rmtree(parts[-1], dir_fd=fd)
        else:
            os.unlink(parts[-1], dir_fd=fd)  # a file, or a link itself
    finally:
        os.close(fd)


def remove(cache: Path, paths: Iterable[str], in_use: Mapping[Path, list[str]]) -> list[str]:
    """Removes every path, or none if any is refused at its check (Refused
    raised): every path is checked before any is removed. One that changed
    since its check (Refused) or a disk error (RemovalFailed) stops the
    removal midway: each names the paths removed before it."""
    raws = list(paths)
    targets = [check(cache, raw, in_use) for raw in raws]
    real_cache = Path(os.path.realpath(cache))
    removed: list[str] = []
    for raw, target in zip(raws, targets, strict=True):
        try:
            _remove_at(real_cache, target, raw)
        except Refused as exc:
            exc.removed = removed
            raise
        except OSError as exc:
            raise RemovalFailed(raw, exc, removed) from exc
        removed.append(raw)
    return raws
