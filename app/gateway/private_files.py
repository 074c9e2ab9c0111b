"""A folder of the gateway's own, and the files its workers exchange in it
(`DATA_DIR/worker-loads/`, `DATA_DIR/worker-metrics/`): nothing another
user planted there is followed, overwritten through or believed.

A worker's snapshot used to be written as `N.tmpPID`, a name anyone can
guess, with an open that follows a symbolic link, in a folder made 0755:
a link planted at that name turned the snapshot into an overwrite of any
file the gateway's user can write (root in the image), and a file planted
under a final name fed another worker's routing. So (docs/design/workers.md):

* the folder is made 0700; one that exists must be a folder (not a link)
  owned by this process's user, else it is refused (`Refused`, an
  `OSError`); one of ours open to others is made 0700, said in the log;
* everything in it is reached from the folder's descriptor, so a folder
  swapped for a link after the check is not followed either;
* a file is written under its temporary name with an exclusive, no-follow
  open (whatever held that name removed first: a link is removed, never
  followed), then renamed over the final name (a rename replaces a link,
  it does not write through it);
* a file is read with a no-follow, non-blocking open, and only if it is a
  regular file of this user's, up to a cap.

Blocking: callers run these in a thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(OSError):
    """A folder or file that is not the gateway's own: not used."""


class Folder:
    """An open private folder (`opened`): its files by name."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    def lstat(self, name: str) -> os.stat_result:
        """The entry itself, a link not followed."""
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def write(self, name: str, data: bytes) -> None:
        """`data` as `name`, whole or not at all: written as `STEM.tmpPID`,
        renamed over `name`."""
        tmp = f"{os.path.splitext(name)[0]}.tmp{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=self.fd)  # an earlier crash's, or planted
        fd = os.open(tmp, _CREATE, 0o600, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def read(self, name: str, limit: int) -> bytes:
        """`name`'s bytes, at most `limit + 1` of them (more: over the cap).
        FileNotFoundError when there is none; `Refused` (saying why, the
        caller names the file) when it is a link, not a regular file, or
        another user's."""
        try:
            fd = os.open(name, _READ, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refused("a symbolic link, not followed") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Refused("not a regular file")
            if st.st_uid != os.geteuid():
                raise Refused(f"owned by uid {st.st_uid}, not by this process's user "
                              f"(uid {os.geteuid()})")
            chunks: list[bytes] = []
            left = limit + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def clear(self) -> None:
        """Every file written here (final and temporary): gone."""
        for name in os.listdir(self.fd):
            if name.endswith(".json") or ".tmp" in name:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.fd)


def _open(path: Path) -> int:
    try:
        return os.open(path, _DIR)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refused(f"{path} is not a folder (a symbolic link or a file): not used; "
                          "remove it") from None
        raise


@contextlib.contextmanager
def opened(path: Path, create: bool = True) -> Iterator[Folder]:
    """The folder at `path`, made 0700 if missing (`create`), checked:
    `Refused` if it is a link, not a folder or another user's; made 0700,
    with a warning, if it is ours and open to others."""
    try:
        fd = _open(path)
    except FileNotFoundError:
        if not create:
            raise
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another worker's, just made
            os.mkdir(path, 0o700)
        fd = _open(path)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise Refused(f"{path} is owned by uid {st.st_uid}, not by this process's user "
                          f"(uid {os.geteuid()}): not used; remove it, or chown it")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
            logger.warning("%s was open to other users (mode %04o): made 0700", path,
                           stat.S_IMODE(st.st_mode))
        yield Folder(path, fd)
    finally:
        os.close(fd)
