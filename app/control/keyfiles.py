"""Provider key files: where they may lie and how they are read
(docs/design/security.md, "Files an admin names").

An external model's `api_key_file` is a path an admin names, read on every
gateway host, and its content is sent as a Bearer token to a URL the admin
also names. So nothing about the file is trusted:

- It must lie under the operator's provider key folder
  (`LLMGW_PROVIDER_KEY_DIR`), after symlinks and `..` are resolved, and not
  be one of the gateway's own secret files (a hard link is caught by inode):
  else an admin token could send the gateway's shared secret to itself.
- It is opened relative to the folder, each component with O_NOFOLLOW, so a
  symlink swapped in after the check cannot lead the open outside; with
  O_NONBLOCK, so a FIFO never blocks the open; it must be a regular file
  (fstat) of at most `MAX_KEY_BYTES`, one line of printable text.
- It is read in a thread of its own, never on the event loop, and waited
  for at most `READ_TIMEOUT` seconds. A thread hung on a dead mount holds
  nothing: no lock, no executor slot; the model is withheld with the reason,
  and no second thread is started for that path until the first returns.

`read_key` is the blocking read; `ProviderKeys` keeps each path's last
outcome for the publisher (app/gateway/publish.py) and the admin API.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import posixpath
import stat
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TypeVar

from app.wire.catalog import KEY_DIR_SETTING as SETTING
from app.wire.catalog import path_problem, under

logger = logging.getLogger(__name__)

# A provider key is tens of bytes; 4 KiB leaves room for a long JWT.
MAX_KEY_BYTES = 4096
# Seconds a read may take before its model is withheld. A local file takes
# microseconds; a network mount a few ms. Longer holds a PUT that long on a
# hung mount; shorter withholds a model on a slow one.
READ_TIMEOUT = 2.0

_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISSOCK, "a socket"))

T = TypeVar("T")


class KeyFileError(Exception):
    """Why a key file cannot be used. `refused`: the path itself breaks the
    policy (a PUT naming it is a 422); else it may become usable (created,
    permissions fixed, the mount back) without a catalog change. The reason
    never holds the key, nor the path (it reaches clients in a 503)."""

    def __init__(self, reason: str, refused: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused


def check_key_dir(key_dir: str, data_dir: os.PathLike[str] | str,
                  named: Iterable[os.PathLike[str] | str]) -> None:
    """The setting, checked at start: an absolute, normalised folder, apart
    from the data directory (the secret, the admin token, the store) and
    holding none of the files other settings name (TLS and etcd keys).
    Lexical only: a hung mount must not hang the start; the read resolves
    symlinks and compares inodes too. ValueError, one line."""
    if not key_dir:
        return
    if not key_dir.startswith("/") or posixpath.normpath(key_dir) != key_dir or key_dir == "/":
        raise ValueError(f"{SETTING} ({key_dir!r}) must be an absolute, normalised folder "
                         "other than /")
    data = posixpath.normpath(posixpath.abspath(data_dir))
    if data == key_dir or under(data, key_dir) or under(key_dir, data):
        raise ValueError(f"{SETTING} ({key_dir}) must not be, hold or lie in LLMGW_DATA_DIR "
                         f"({data}), which holds the gateway's secrets")
    for f in named:
        if under(posixpath.normpath(posixpath.abspath(f)), key_dir):
            raise ValueError(f"{SETTING} ({key_dir}) holds {f}, a file another setting names: "
                             "keep only provider keys there")


def own_files(data_dir: os.PathLike[str] | str,
              named: Iterable[os.PathLike[str] | str]) -> list[str]:
    """The gateway's files no key file may be (by inode): its secret, admin
    token and store in `data_dir`, and the files its settings name."""
    return [os.fspath(p) for p in named] + [
        os.path.join(data_dir, f) for f in ("secret", "admin-token", "state.db")]


def read_key(path: str, key_dir: str, own_files: Collection[str] = ()) -> str:
    """The key in `path`, stripped. Blocking: call it in a thread.

    Raises KeyFileError. `own_files` are the gateway's secret files (its
    secret, admin token, TLS and etcd keys): the same inode is refused.
    """
    problem = path_problem(path, key_dir)
    if problem is not None:
        raise KeyFileError(problem, refused=True)
    root = os.path.realpath(key_dir)
    real = os.path.realpath(path)  # a symlink inside may point elsewhere in the folder
    if not under(real, root):
        raise KeyFileError(f"it resolves (symlinks followed) outside the provider key "
                           f"folder {key_dir}", refused=True)
    parts = real[len(root.rstrip("/")) + 1:].split("/")
    try:
        fd = _open_beneath(root, parts)
    except KeyFileError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise KeyFileError("it does not exist", refused=False) from None
        if exc.errno == errno.ELOOP:
            raise KeyFileError("it changed while being opened (a symlink swapped in)",
                               refused=False) from None
        raise KeyFileError(exc.strerror or type(exc).__name__, refused=False) from None
    try:
        st = os.fstat(fd)
        for is_kind, kind in _KINDS:
            if is_kind(st.st_mode):
                raise KeyFileError(f"it is not a regular file ({kind})", refused=True)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError("it is not a regular file", refused=True)
        if (st.st_dev, st.st_ino) in _inodes(own_files):
            raise KeyFileError("it is one of the gateway's own secret files", refused=True)
        if st.st_size > MAX_KEY_BYTES:
            raise KeyFileError(f"it holds {st.st_size} bytes; a key file holds at most "
                               f"{MAX_KEY_BYTES}", refused=True)
        data = _read_capped(fd)
    finally:
        os.close(fd)
    try:
        key = data.decode().strip()
    except UnicodeDecodeError:
        raise KeyFileError("it is not UTF-8 text", refused=False) from None
    if not key:
        raise KeyFileError("it is empty", refused=False)
    if not key.isprintable() or " " in key:
        # It becomes an Authorization header: a newline would split it.
        raise KeyFileError("it must hold one line without spaces or control characters",
                           refused=False)
    return key


def _open_beneath(root: str, parts: list[str]) -> int:
    """Opens root/parts[0]/.../parts[-1] one component at a time, none a
    symlink: what was checked under the folder is what is opened."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_NOFOLLOW
                          | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = sub
        return os.open(parts[-1], _OPEN, dir_fd=fd)
    finally:
        os.close(fd)


def _read_capped(fd: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(fd, MAX_KEY_BYTES + 1 - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_KEY_BYTES:  # grew since fstat
            raise KeyFileError(f"it holds more than {MAX_KEY_BYTES} bytes", refused=True)


def _inodes(paths: Collection[str]) -> set[tuple[int, int]]:
    out = set()
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


def in_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """`fn()` in a daemon thread of its own, its outcome as a future.

    Not asyncio.to_thread: the default executor has a few workers, and
    threads hung on a dead mount would fill it for every other caller; nor
    would its threads let the process exit. The future may be waited for
    with a timeout; the thread then finishes (or hangs) on its own."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, exc: Exception | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)  # type: ignore[arg-type]

    def work() -> None:
        try:
            value, exc = fn(), None
        except Exception as e:  # handed to the loop whole
            value, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:
            pass  # the loop closed meanwhile: no one waits

    threading.Thread(target=work, name="provider-key", daemon=True).start()
    return fut


@dataclass(frozen=True)
class KeyState:
    """A key file's last outcome: the key, or why it cannot be used."""

    key: str | None
    error: str = ""
    refused: bool = False


class ProviderKeys:
    """Each key file's last outcome, read in the background.

    `get(path)` answers from what was last read (None: nothing yet, a read
    is started); `refresh(paths)` rereads them (a rotated key); a changed
    outcome calls the subscribers (the publisher republishes). At most one
    read per path runs at a time, however long it hangs.
    """

    def __init__(self, key_dir: str, own_files: Collection[str] = (),
                 timeout: float = READ_TIMEOUT,
                 reader: Callable[[str, str, Collection[str]], str] = read_key) -> None:
        self.key_dir = key_dir
        self._own = tuple(own_files)
        self._timeout = timeout
        self._reader = reader
        self._states: dict[str, KeyState] = {}
        self._reading: dict[str, asyncio.Future[KeyState]] = {}
        self._subscribers: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._subscribers.append(callback)

    def get(self, path: str) -> KeyState | None:
        state = self._states.get(path)
        if state is None:
            self._start(path)
        return state

    def refresh(self, paths: Iterable[str]) -> None:
        for path in paths:
            self._start(path)

    def retain(self, paths: Collection[str]) -> None:
        """Forgets the outcomes of paths no model names any more."""
        for path in set(self._states) - set(paths):
            del self._states[path]

    async def read_now(self, path: str) -> KeyState:
        """Reads `path` (or joins the read under way) and waits for it, at
        most the timeout: the admin API's check of a PUT."""
        done = self._start(path)
        try:
            return await asyncio.wait_for(asyncio.shield(done), self._timeout)
        except TimeoutError:
            return self._timed_out()

    def _timed_out(self) -> KeyState:
        return KeyState(None, f"reading it took over {self._timeout:g} s (a hung mount?)")

    def _start(self, path: str) -> asyncio.Future[KeyState]:
        running = self._reading.get(path)
        if running is not None:
            return running
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[KeyState] = loop.create_future()
        self._reading[path] = outcome
        read = in_thread(lambda: self._reader(path, self.key_dir, self._own))
        late = loop.call_later(self._timeout, self._late, path, read)

        def finished(f: asyncio.Future[str]) -> None:
            late.cancel()
            self._reading.pop(path, None)
            exc = f.exception()
            if exc is None:
                state = KeyState(f.result())
            elif isinstance(exc, KeyFileError):
                state = KeyState(None, exc.reason, exc.refused)
            else:
                logger.error("reading key file %s failed", path, exc_info=exc)
                state = KeyState(None, f"reading it failed ({type(exc).__name__})")
            self._set(path, state)
            outcome.set_result(state)

        read.add_done_callback(finished)
        return outcome

    def _late(self, path: str, read: asyncio.Future[str]) -> None:
        if not read.done():
            self._set(path, self._timed_out())

    def _set(self, path: str, state: KeyState) -> None:
        before = self._states.get(path)
        self._states[path] = state
        if before == state:
            return
        if state.key is None:
            logger.warning("provider key file %s cannot be used: %s", path, state.error)
        elif before is not None and before.key is None:
            logger.info("provider key file %s is usable again", path)
        for callback in self._subscribers:
            callback()
