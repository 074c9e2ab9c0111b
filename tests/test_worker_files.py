"""The files a gateway's workers exchange in DATA_DIR (`--workers N`):
engine loads (app/gateway/worker_loads.py) and request figures
(app/gateway/worker_metrics.py), both through app/gateway/private_files.py.
A link planted in their folder is never written through nor read, the
folder is the gateway user's own and 0700. docs/design/workers.md."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.gateway import private_files, worker_loads, worker_metrics, workers
from app.gateway.request_metrics import RequestMetrics
from app.gateway.settings import Settings
from app.gateway.worker_loads import WorkerLoads
from app.gateway.worker_metrics import WorkerMetrics
from app.router.choice import EngineLoad
from app.router.outcome import Outcome
from tests.support.scrape import collected
from tests.test_node_loads import Clock

PRECIOUS = b"a file the gateway's user can write, and nothing may change\n"
LOAD = EngineLoad(1.0, 0.0, 0.5, 99.0)
REQUESTS = ("llmgw_requests_total", (("code", "200"), ("model", "m")))


class Loads:
    """Worker `index` of 2's engine loads: what it writes, what it reads."""

    folder = worker_loads.FOLDER
    clear = staticmethod(worker_loads.clear)

    def __init__(self, data_dir: Path, index: int) -> None:
        self.w = WorkerLoads(data_dir, index, 2, clock=Clock(100.0))
        self.n = 0

    def write(self) -> None:
        self.n += 1  # a new figure each time: the file changes
        self.w.write({"a": EngineLoad(float(self.n), 0.0, 0.5, 99.0)})

    def others(self) -> bool:
        """Whether the other worker's figures are taken."""
        return "a" in (self.w.read() or {})


class Metrics:
    """Worker `index` of 2's request figures."""

    folder = worker_metrics.FOLDER
    clear = staticmethod(worker_metrics.clear)

    def __init__(self, data_dir: Path, index: int) -> None:
        self.m = RequestMetrics()
        self.w = WorkerMetrics(self.m, data_dir, index, 2)

    def write(self) -> None:
        self.m.observe(Outcome("m", 200, 0.2))  # a new figure each time: the file changes
        self.w.write(self.m.snapshot())

    def others(self) -> bool:
        """Whether the other worker's requests are summed with this one's."""
        summed = collected(self.w.totals(self.m.snapshot())).get(REQUESTS, 0)
        return summed > collected(self.m).get(REQUESTS, 0)


KINDS: list[Callable[[Path, int], Any]] = [Loads, Metrics]


@pytest.fixture(params=KINDS, ids=["loads", "metrics"])
def kind(request: pytest.FixtureRequest) -> Callable[[Path, int], Any]:
    made: Callable[[Path, int], Any] = request.param
    return made


def victim(tmp_path: Path) -> Path:
    target = tmp_path / "victim"
    target.write_bytes(PRECIOUS)
    return target


def test_a_link_at_the_temporary_name_is_not_followed(
        kind: Callable[[Path, int], Any], tmp_path: Path) -> None:
    me, other = kind(tmp_path / "data", 0), kind(tmp_path / "data", 1)
    me.write()  # the folder exists: a link can be planted in it
    folder = tmp_path / "data" / me.folder
    target = victim(tmp_path)
    (folder / f"0.tmp{os.getpid()}").symlink_to(target)  # the name it writes next
    me.write()
    assert target.read_bytes() == PRECIOUS, "the snapshot was written through the link"
    assert stat.S_ISREG((folder / "0.json").lstat().st_mode)
    assert other.others()  # the real file is there, and read
    assert not [p.name for p in folder.iterdir() if ".tmp" in p.name]  # the link went


def test_a_link_at_the_final_name_is_replaced_not_followed(
        kind: Callable[[Path, int], Any], tmp_path: Path) -> None:
    me, other = kind(tmp_path / "data", 0), kind(tmp_path / "data", 1)
    me.clear(tmp_path / "data")  # what the supervisor does first: makes the folder
    target = victim(tmp_path)
    (tmp_path / "data" / me.folder / "0.json").symlink_to(target)
    me.write()
    assert target.read_bytes() == PRECIOUS
    assert stat.S_ISREG((tmp_path / "data" / me.folder / "0.json").lstat().st_mode)
    assert other.others()


def test_another_workers_file_as_a_link_is_not_read(
        kind: Callable[[Path, int], Any], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # A good file, elsewhere (another data dir), linked in as worker 1's.
    kind(tmp_path / "elsewhere", 1).write()
    me = kind(tmp_path / "data", 0)
    me.write()
    (tmp_path / "data" / me.folder / "1.json").symlink_to(
        tmp_path / "elsewhere" / me.folder / "1.json")
    with caplog.at_level(logging.WARNING):
        assert not me.others(), "a linked file was read"
    said = [r.getMessage() for r in caplog.records if "worker 1's" in r.getMessage()]
    assert len(said) == 1 and "symbolic link" in said[0], said


def test_the_folder_is_made_private_and_a_wider_one_of_ours_narrowed(
        kind: Callable[[Path, int], Any], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    me = kind(data, 0)
    folder = data / me.folder
    old = os.umask(0o022)  # the usual one: a plain mkdir makes 0755
    try:
        me.clear(data)  # the supervisor makes it
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        folder.rmdir()
        me.write()  # or a worker, writing first
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / "0.json").stat().st_mode) == 0o600
        folder.chmod(0o755)  # an older version's
        with caplog.at_level(logging.WARNING):
            me.write()
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{folder} was open to other users (mode 0755): made 0700"], said


def _not_ours(tmp_path: Path, folder: Path) -> int:
    """`folder`, made and given to another user: its uid. Only root can give
    a folder away, so the tests run as root (scripts/install-test.sh)."""
    folder.mkdir(parents=True, mode=0o700)
    assert os.geteuid() == 0, "giving a folder to another user needs root"
    os.chown(folder, 65534, 65534)
    return 65534


def test_a_folder_that_is_a_link_or_another_users_is_refused(
        kind: Callable[[Path, int], Any], tmp_path: Path,
) -> None:
    # A link to a folder elsewhere: refused, not followed.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    me = kind(tmp_path / "linked", 0)
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / me.folder).symlink_to(elsewhere)
    with pytest.raises(private_files.Refused, match="is not a folder"):
        me.write()
    with pytest.raises(private_files.Refused, match="is not a folder"):
        me.clear(tmp_path / "linked")
    assert list(elsewhere.iterdir()) == []

    # Another user's folder: refused, left as it is.
    uid = _not_ours(tmp_path, tmp_path / "theirs" / me.folder)
    me = kind(tmp_path / "theirs", 0)
    with pytest.raises(private_files.Refused, match=f"owned by uid {uid}, not by"):
        me.write()
    with pytest.raises(private_files.Refused, match=f"owned by uid {uid}, not by"):
        me.clear(tmp_path / "theirs")
    assert list((tmp_path / "theirs" / me.folder).iterdir()) == []


def test_a_gateway_with_workers_does_not_start_on_a_folder_not_its_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The supervisor makes both folders before any worker starts: one it
    refuses stops `llmgw serve` (exit 2) saying why, nothing bound."""
    uid = _not_ours(tmp_path, tmp_path / worker_loads.FOLDER)
    # Its port taken: had it gone on, it would have stopped there, saying so.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = Settings(data_dir=tmp_path, etcd_endpoints="127.0.0.1:9", gateway_id="gw",
                            secret="s" * 32, admin_token="a" * 32, workers=2,
                            host="127.0.0.1", port=taken.getsockname()[1])
        with pytest.raises(SystemExit) as ended:
            workers.supervise("info", "text", settings, 2, lambda: None)
    assert ended.value.code == workers.REFUSED
    err = capsys.readouterr().err
    assert f"{tmp_path / worker_loads.FOLDER} is owned by uid {uid}" in err, err
    assert stat.S_IMODE((tmp_path / worker_metrics.FOLDER).stat().st_mode) == 0o700


def test_a_file_that_is_not_a_regular_file_of_ours_is_refused(tmp_path: Path) -> None:
    with private_files.opened(tmp_path / "f") as folder:
        os.mkfifo(tmp_path / "f" / "fifo.json")  # would block a plain open
        with pytest.raises(private_files.Refused, match="not a regular file"):
            folder.read("fifo.json", 10)
        (tmp_path / "f" / "theirs.json").write_text(json.dumps({}))
        os.chown(tmp_path / "f" / "theirs.json", 65534, 65534)
        with pytest.raises(private_files.Refused, match="owned by uid 65534"):
            folder.read("theirs.json", 10)
        folder.write("mine.json", b"0123456789abc")
        assert folder.read("mine.json", 10) == b"0123456789a"  # the cap, and one more
        with pytest.raises(FileNotFoundError):
            folder.read("none.json", 10)
