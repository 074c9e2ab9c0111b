"""An agent's self-upgrade (app/agent/upgrade.py): it installs the version
asked for, re-executes itself on it and adopts its engines."""

from __future__ import annotations

import asyncio
import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import sysconfig
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from app import __version__
from app.agent.upgrade import (
    UpgradeConfig,
    UpgradeError,
    Upgrader,
    installer_argv,
    reexec_argv,
    shown,
)
from app.control import agentversion
from app.control import state as s
from app.control.keys import node_token
from app.control.placement import Fit, NoFit, Placer
from tests.support.procs import (
    ADMIN,
    ROOT,
    SECRET,
    Cluster,
    Proc,
    engine_pid,
    put_model,
    serve_one,
    wait_for,
)

# --- the installer's command line, the restart's, and failures -------------------------


def test_installer_argv_default_and_index() -> None:
    cfg = UpgradeConfig(extra_args=["--no-index", "--find-links", "/srv/w"])
    assert installer_argv(cfg, "0.2.0", None, python="/v/bin/python") == [
        "/v/bin/python", "-m", "pip", "install", "--no-deps", "llmgw==0.2.0",
        "--no-index", "--find-links", "/srv/w"]
    assert installer_argv(UpgradeConfig(), "1.0", "https://pypi.example/simple",
                          python="py")[-2:] == ["--index-url", "https://pypi.example/simple"]


def test_index_credentials_are_masked_in_the_log() -> None:
    argv = installer_argv(UpgradeConfig(), "1.0", "https://me:s3cret@pypi.example/simple")
    assert "s3cret" not in shown(argv) and "https://***@pypi.example/simple" in shown(argv)


@pytest.mark.parametrize("version", ["", "x1", "1.0 --pre", "1;rm", "--index-url=x"])
def test_installer_refuses_what_is_not_a_version(version: str) -> None:
    with pytest.raises(UpgradeError) as err:
        installer_argv(UpgradeConfig(), version, None)
    assert err.value.status == 400


def test_installer_refuses_an_index_that_is_not_a_url() -> None:
    with pytest.raises(UpgradeError) as err:
        installer_argv(UpgradeConfig(), "1.0", "-e evil")
    assert err.value.status == 400


@pytest.mark.parametrize("argv0", ["/usr/local/bin/llmgw", "/repo/app/cli.py"])
def test_reexec_keeps_the_agent_arguments(argv0: str) -> None:
    argv = [argv0, "agent", "--gateway", "http://g", "--node", "n1"]
    assert reexec_argv(argv, python="/v/bin/python") == [
        "/v/bin/python", "-m", "app.cli", "agent", "--gateway", "http://g", "--node", "n1"]


async def test_failed_install_keeps_the_agent_running() -> None:
    restarts: list[str] = []
    script = "import sys; print('no such version', sys.argv[1]); sys.exit(3)"
    cfg = UpgradeConfig(installer=f"{{python}} -c {script!r} {{version}}")
    up = Upgrader(cfg, restarts.append)
    with pytest.raises(UpgradeError) as err:
        await up.upgrade("9.9.9")
    assert (err.value.status, err.value.output) == (422, ["no such version 9.9.9"])
    assert "exited with 3" in err.value.detail
    assert up.installed is None and restarts == []


async def test_installer_past_its_timeout_is_killed() -> None:
    cfg = UpgradeConfig(installer="{python} -c 'import time; time.sleep(30)'", timeout=0.3)
    up = Upgrader(cfg, lambda v: None)
    with pytest.raises(UpgradeError, match=r"ran past 0\.3 s"):
        await up.upgrade("1.0")
    assert up.installed is None


async def test_one_upgrade_at_a_time_then_restart() -> None:
    restarted = asyncio.Event()
    restarts: list[str] = []

    def restart(version: str) -> None:
        restarts.append(version)
        restarted.set()

    cfg = UpgradeConfig(installer="{python} -c 'import time; time.sleep(0.5); print(\"ok\")'")
    up = Upgrader(cfg, restart)
    first = asyncio.create_task(up.upgrade("1.2.3"))
    # One step: the task takes the lock before its first suspension (the
    # installer's start).
    await asyncio.sleep(0)
    with pytest.raises(UpgradeError) as err:
        await up.upgrade("1.2.4")
    assert err.value.status == 409
    assert await first == ["ok"]
    await asyncio.wait_for(restarted.wait(), 5)
    assert restarts == ["1.2.3"]
    with pytest.raises(UpgradeError) as err:  # restarting now: refused too
        await up.upgrade("1.2.4")
    assert err.value.status == 409


# --- the supported version window -------------------------------------------------------


@pytest.mark.parametrize(("version", "refused"), [
    ("0.3.0", False), ("0.3.2", False), ("0.3.4", False), ("", False),
    ("0.2.9", True), ("0.3.5", True), ("0.4.0", True), ("0.3.4.post1", True),
    ("0.3.0rc1", True), ("not-a-version", True),
])
def test_window_refuses_older_and_newer_agents(version: str, refused: bool) -> None:
    why = agentversion.Window("0.3.0", "0.3.4").refusal(version)
    assert (why is not None) == refused, why
    if refused:
        assert why == (f"agent version {version} is outside the supported window "
                       "[0.3.0, 0.3.4]")


def test_window_default_is_this_minor_up_to_this_version() -> None:
    assert agentversion.minor_floor("1.7.3") == "1.7.0"
    assert agentversion.minor_floor("2.0") == "2.0.0"


def test_placement_skips_agents_outside_the_window() -> None:
    def node(name: str, version: str) -> s.NodeInfo:
        return s.NodeInfo(name=name, version=version, gpus=[s.GpuInfo(index=0)],
                          engines=["vllm"])

    spec = s.StoredModel(name="m", model="org/m")
    window = agentversion.Window("0.3.0", "0.3.4")
    nodes = {"old": node("old", "0.2.1"), "new": node("new", "0.4.0")}
    fit = Placer(nodes, {}, agent_versions=window).place("m", spec)
    assert isinstance(fit, NoFit)
    assert fit.reasons == {
        "old": "agent version 0.2.1 is outside the supported window [0.3.0, 0.3.4]",
        "new": "agent version 0.4.0 is outside the supported window [0.3.0, 0.3.4]"}
    nodes["ok"] = node("ok", "0.3.1")
    fit = Placer(nodes, {}, agent_versions=window).place("m", spec)
    assert isinstance(fit, Fit) and fit.node == "ok"


# --- the whole path: a wheel built here, a venv of its own, through a gateway ----------


def build_wheel(version: str, out: Path) -> Path:
    """A wheel of this checkout's `app` package at `version` (its
    __version__ rewritten), written by hand: the wheel format is a zip with
    a dist-info (PEP 427), and needs no build backend or index here."""
    name = f"llmgw-{version}"
    files: dict[str, bytes] = {}
    for path in sorted((ROOT / "app").rglob("*.py")):
        data = path.read_bytes()
        if path == ROOT / "app" / "__init__.py":
            data = data.replace(f'__version__ = "{__version__}"'.encode(),
                                f'__version__ = "{version}"'.encode())
        files[path.relative_to(ROOT).as_posix()] = data
    info = f"llmgw-{version}.dist-info"
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: llmgw\n"
                                 f"Version: {version}\n").encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: tests/test_upgrade.py\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    files[f"{info}/entry_points.txt"] = b"[console_scripts]\nllmgw = app.cli:main\n"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for arc, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        writer.writerow([arc, f"sha256={digest.decode()}", len(data)])
    writer.writerow([f"{info}/RECORD", "", ""])
    files[f"{info}/RECORD"] = record.getvalue().encode()
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files.items():
            z.writestr(arc, data)
    return wheel


def make_venv(where: Path) -> Path:
    """A venv whose own site-packages will hold llmgw, non-editable; the
    dependencies (and pip) come from this interpreter's environment, added
    after it by a path line (whose .pth files, the editable install's
    hook among them, are not run)."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)],
                   check=True)
    python = where / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True)
    Path(site.stdout.strip(), "zz-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@dataclass
class VenvAgent(Proc):
    """An agent run by another interpreter, away from this checkout (so
    `-m app.cli` imports the installed package, never ./app)."""

    python: str = ""
    cwd: str = ""

    def start(self) -> Proc:
        env = self.env | dict([self.tag.split("=", 1)])
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                [self.python, "-m", "app.cli", *self.args], cwd=self.cwd, env=env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        return self


def test_agent_upgrades_itself_and_keeps_its_engines(cluster: Cluster, tmp_path: Path) -> None:
    new_version = __version__ + ".post1"
    wheels = tmp_path / "wheels"
    current = build_wheel(__version__, tmp_path / "current")
    build_wheel(new_version, wheels)
    python = make_venv(tmp_path / "venv")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index",
                    "--ignore-installed", "--disable-pip-version-check", "-q", str(current)],
                   check=True, cwd=tmp_path)

    gw = cluster.gateway("gw-a")
    env = cluster.base_env()
    env.pop("LLMGW_SECRET")
    env.pop("PYTHONPATH", None)
    env.update({"LLMGW_AGENT_TOKEN": node_token(SECRET, "node-1"),
                "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "LLMGW_AGENT_INSTALLER_ARGS": f"--no-index --find-links {wheels}"})
    agent = VenvAgent("agent-node-1", [
        "agent", "--gateway", gw.url, "--node", "node-1", "--gpus", "1",
        "--work-dir", str(tmp_path / "agent-node-1")], env, tmp_path / "agent-node-1.log",
        python=str(python), cwd=str(tmp_path))
    agent.start()
    cluster.procs.append(agent)

    def version() -> str | None:
        with gw.admin() as admin:
            nodes = {n["name"]: n for n in admin.get("/admin/nodes").json()}
        return nodes["node-1"].get("version") if "node-1" in nodes else None

    assert wait_for(version, 20, "node-1 in the fleet") == __version__
    served = serve_one(gw, f"up-{uuid.uuid4().hex[:8]}")
    pid_before = agent.popen.pid if agent.popen else 0

    with gw.admin() as admin:
        admin.timeout = 120
        r = admin.post("/admin/nodes/node-1/upgrade", json={"version": new_version})
    assert r.status_code == 200, (r.text, agent.output()[-3000:])
    assert (r.json()["from"], r.json()["version"]) == (__version__, new_version)

    wait_for(lambda: version() == new_version, 60, f"node-1 on {new_version}")
    # The same agent process, re-executed; the same engine, adopted.
    assert agent.popen is not None and agent.popen.pid == pid_before
    assert agent.popen.poll() is None
    assert f"adopted engine of {served.replica['id']}" in agent.output()
    assert engine_pid(served.replica["url"]) == served.pid
    installed = subprocess.run([python, "-c", "import app; print(app.__file__)"],
                               capture_output=True, text=True, cwd=tmp_path, check=True)
    assert str(tmp_path / "venv") in installed.stdout  # never this checkout's ./app

    # 0.1.0.post1 is newer than this gateway: node-1 keeps its replica (above)
    # but gets no new one, and says why.
    put_model(gw, "second", {"model": "acme/m", "gpus": 1})
    with gw.admin() as admin:
        status = admin.get("/admin/models/second").json()["status"]
    assert status["unplaced"] == (f"node-1: agent version {new_version} is outside the "
                                  f"supported window [{agentversion.minor_floor(__version__)}"
                                  f", {__version__}]"), status

    # A version that is not there: refused with the installer's lines, the
    # agent runs on.
    # The agent's 422 comes through the gateway and `llmgw ctl upgrade`.
    ctl = subprocess.run(
        [sys.executable, "-m", "app.cli", "ctl", "upgrade", "node-1", "99.0.0",
         "--gateway", gw.url], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=cluster.base_env() | {"LLMGW_ADMIN_TOKEN": ADMIN})
    assert ctl.returncode == 1, (ctl.stdout, ctl.stderr)
    assert "answered 422: Upgrade failed: the installer exited with 1" in ctl.stderr
    with gw.admin() as admin:
        admin.timeout = 120
        r = admin.post("/admin/nodes/node-1/upgrade", json={"version": "99.0.0"})
    assert r.status_code == 422, r.text
    assert any("99.0.0" in line for line in r.json()["output"]), r.text
    with gw.admin() as admin:  # refused by the gateway, before the agent
        r = admin.post("/admin/nodes/node-1/upgrade", json={"version": "1.0 --pre"})
    assert r.status_code == 422 and "version" in r.text, r.text
    assert version() == new_version and agent.popen.poll() is None
    assert os.path.exists(tmp_path / "agent-node-1" / "engines.json")


def test_min_agent_version_setting_must_be_a_version() -> None:
    from pydantic import ValidationError

    from app.settings import Settings

    assert Settings(min_agent_version="0.1.0").min_agent_version == "0.1.0"
    with pytest.raises(ValidationError, match="is not a version"):
        Settings(min_agent_version="x y")
