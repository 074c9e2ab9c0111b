"""An agent's self-upgrade (app/agent/upgrade.py): it installs the version
asked for, re-executes itself on it and adopts its engines."""

from __future__ import annotations

import asyncio
import base64
import csv
import hashlib
import io
import logging
import os
import subprocess
import sys
import sysconfig
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app import __version__
from app.agent.upgrade import (
    UpgradeConfig,
    UpgradeError,
    Upgrader,
    parse_source,
    reexec_argv,
)
from app.control import state as s
from app.control.placement import agentversion
from app.control.placement.placer import Placer
from app.control.placement.verdict import Fit, NoFit
from app.wire.tokens import node_token
from tests.support.procs import (
    ADMIN,
    ROOT,
    SECRET,
    Cluster,
    Proc,
    engine_pid,
    serve_one,
    until,
    wait_for,
)

# --- where upgrades come from, what is installed, and when it is refused -----------------

SHA_ZERO = "0" * 64


def stand_in_python(tmp: Path, download: bool = True, sleep: float = 0.0) -> str:
    """An interpreter for the Upgrader: `-m pip download` goes to this
    environment's real pip (from the node's source only, as set in pip's
    environment); `-m pip install` only records its arguments, never
    installing into this environment. Every run's argv and PIP_ environment
    are appended to tmp/runs."""
    path = tmp / "python"
    real = f"exec {sys.executable} \"$@\"" if download else "exit 7"
    path.write_text(f"""#!/bin/sh
echo "argv: $*" >> {tmp}/runs
env | grep '^PIP_' | sed 's/^/env: /' >> {tmp}/runs
sleep {sleep}
if [ "$3" = download ]; then {real}; fi
echo "installed $*"
""")
    path.chmod(0o755)
    return str(path)


def no_origin_problem() -> None:
    return None


def upgrader(tmp: Path, source: str, restarts: list[str] | None = None,
             **python: Any) -> Upgrader:
    cfg = UpgradeConfig(source=parse_source(source), python=stand_in_python(tmp, **python),
                        origin_problem=no_origin_problem)
    return Upgrader(cfg, (restarts if restarts is not None else []).append)


async def test_without_a_source_configured_on_the_node_upgrades_are_refused(
    tmp_path: Path
) -> None:
    up = Upgrader(UpgradeConfig(python=stand_in_python(tmp_path),
                                origin_problem=no_origin_problem), lambda v: None)
    with pytest.raises(UpgradeError) as err:
        await up.upgrade("0.1.0", SHA_ZERO)
    assert (err.value.status, err.value.title) == (409, "Upgrades not enabled on this node")
    assert "LLMGW_AGENT_UPGRADE_SOURCE is not set" in err.value.detail
    assert not (tmp_path / "runs").exists()  # nothing ran


@pytest.mark.parametrize(("raw", "ok"), [
    ("", True), ("https://me:pw@pypi.example/simple", True), ("/srv/wheels", True),
    ("ftp://x/simple", False), ("wheels", False), ("file:///srv/wheels", False),
])
def test_the_source_setting_is_an_index_url_or_a_wheel_folder(raw: str, ok: bool) -> None:
    if ok:
        parse_source(raw)
    else:
        with pytest.raises(ValueError, match="LLMGW_AGENT_UPGRADE_SOURCE"):
            parse_source(raw)


async def test_only_the_wheel_of_the_named_sha256_is_installed(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheel = build_wheel("0.1.0", wheels)
    restarts: list[str] = []
    up = upgrader(tmp_path, str(wheels), restarts)
    with pytest.raises(UpgradeError) as err:
        await up.upgrade("0.1.0", SHA_ZERO)
    assert err.value.status == 422 and err.value.title == "Wheel refused"
    got = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert f"has sha256 {got}, not {SHA_ZERO}; nothing installed" in err.value.detail
    runs = (tmp_path / "runs").read_text()
    assert "argv: -m pip download" in runs and "argv: -m pip install" not in runs
    assert "env: PIP_NO_INDEX=1" in runs and f"env: PIP_FIND_LINKS={wheels}" in runs

    lines = await up.upgrade("0.1.0", got)
    (install,) = [x for x in (tmp_path / "runs").read_text().splitlines()
                  if x.startswith("argv: -m pip install")]
    assert install.startswith("argv: -m pip install --no-deps --no-index --no-input /")
    assert install.endswith("/llmgw-0.1.0-py3-none-any.whl"), install
    assert lines and lines[-1].startswith("installed -m pip install")
    await until(lambda: restarts == ["0.1.0"], "restart asked")


async def test_index_credentials_never_reach_a_command_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.agent.upgrade")
    source = "https://me:s3cret@pypi.example/simple"
    up = upgrader(tmp_path, source, download=False)
    with pytest.raises(UpgradeError) as err:
        await up.upgrade("0.1.0", SHA_ZERO)
    assert (err.value.status, err.value.detail) == (422, "pip download exited with 7; this "
                                                    "agent runs on")
    runs = (tmp_path / "runs").read_text()
    argv = [x for x in runs.splitlines() if x.startswith("argv: ")]
    assert argv and not any("s3cret" in x or "pypi.example" in x for x in argv), argv
    assert f"env: PIP_INDEX_URL={source}" in runs  # pip's environment: the user's own
    assert "s3cret" not in caplog.text and "https://***@pypi.example/simple" in caplog.text


@pytest.mark.parametrize(("version", "sha"), [
    ("", SHA_ZERO), ("x1", SHA_ZERO), ("1.0 --pre", SHA_ZERO), ("--index-url=x", SHA_ZERO),
    ("1.0", "abc"), ("1.0", "A" * 64), ("1.0", SHA_ZERO + " x"),
])
async def test_a_request_that_is_not_a_version_and_a_hash_is_refused(
    tmp_path: Path, version: str, sha: str
) -> None:
    with pytest.raises(UpgradeError) as err:
        await upgrader(tmp_path, "/srv/wheels").upgrade(version, sha)
    assert err.value.status == 400
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv0", ["/usr/local/bin/llmgw", "/repo/app/cli.py"])
def test_reexec_keeps_the_agent_arguments(argv0: str) -> None:
    argv = [argv0, "agent", "--gateway", "http://g", "--node", "n1"]
    assert reexec_argv(argv, python="/v/bin/python") == [
        "/v/bin/python", "-m", "app.cli", "agent", "--gateway", "http://g", "--node", "n1"]


async def test_failed_download_keeps_the_agent_running(tmp_path: Path) -> None:
    restarts: list[str] = []
    up = upgrader(tmp_path, str(tmp_path / "empty"), restarts)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UpgradeError) as err:
        await up.upgrade("9.9.9", SHA_ZERO)
    assert err.value.status == 422 and "pip download exited with 1" in err.value.detail
    assert any("9.9.9" in line for line in err.value.output), err.value.output
    assert up.installed is None and restarts == []


async def test_pip_past_its_timeout_is_killed(tmp_path: Path) -> None:
    up = upgrader(tmp_path, "/srv/wheels", sleep=30)
    up.cfg.timeout = 0.3
    with pytest.raises(UpgradeError, match=r"ran past 0\.3 s"):
        await up.upgrade("1.0", SHA_ZERO)
    assert up.installed is None


async def test_one_upgrade_at_a_time(tmp_path: Path) -> None:
    up = upgrader(tmp_path, "/srv/wheels", download=False, sleep=0.5)
    first = asyncio.create_task(up.upgrade("1.2.3", SHA_ZERO))
    # One step: the task takes the lock before its first suspension.
    await asyncio.sleep(0)
    with pytest.raises(UpgradeError) as err:
        await up.upgrade("1.2.4", SHA_ZERO)
    assert err.value.status == 409
    with pytest.raises(UpgradeError) as err:
        await first
    assert err.value.status == 422  # the stand-in's download fails


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
    assert fit.texts() == {
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
    # From an older agent, within the window, to this gateway's own version.
    old_version, new_version = "0.0.9", __version__
    wheels = tmp_path / "wheels"
    current = build_wheel(old_version, tmp_path / "current")
    wheel = build_wheel(new_version, wheels)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    python = make_venv(tmp_path / "venv")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index",
                    "--ignore-installed", "--disable-pip-version-check", "-q", str(current)],
                   check=True, cwd=tmp_path)

    gw = cluster.gateway("gw-a", min_agent_version="0.0.1")
    env = cluster.base_env()
    env.pop("LLMGW_SECRET")
    env.pop("PYTHONPATH", None)
    env.update({"LLMGW_AGENT_TOKEN": node_token(SECRET, "node-1"),
                "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "LLMGW_AGENT_UPGRADE_SOURCE": str(wheels)})
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

    assert wait_for(version, 20, "node-1 in the fleet") == old_version
    served = serve_one(gw, f"up-{uuid.uuid4().hex[:8]}")
    pid_before = agent.popen.pid if agent.popen else 0

    with gw.admin() as admin:
        admin.timeout = 120
        # Another wheel's hash: refused by the agent, which runs on.
        r = admin.post("/admin/nodes/node-1/upgrade",
                       json={"version": new_version, "sha256": SHA_ZERO})
        assert r.status_code == 422 and "nothing installed" in r.text, r.text
        r = admin.post("/admin/nodes/node-1/upgrade", json={"version": new_version,
                                                             "sha256": sha})
    assert r.status_code == 200, (r.text, agent.output()[-3000:])
    assert (r.json()["from"], r.json()["version"]) == (old_version, new_version)

    wait_for(lambda: version() == new_version, 60, f"node-1 on {new_version}")
    # The same agent process, re-executed; the same engine, adopted.
    assert agent.popen is not None and agent.popen.pid == pid_before
    assert agent.popen.poll() is None
    agent.logged(f"adopted engine of {served.replica['id']}")
    assert engine_pid(served.replica["url"]) == served.pid
    installed = subprocess.run([python, "-c", "import app; print(app.__file__)"],
                               capture_output=True, text=True, cwd=tmp_path, check=True)
    assert str(tmp_path / "venv") in installed.stdout  # never this checkout's ./app

    # A version the source does not hold: refused with pip's lines, the
    # agent runs on. The agent's 422 comes through the gateway and `llmgw
    # ctl upgrade`.
    ctl = subprocess.run(
        [sys.executable, "-m", "app.cli", "ctl", "upgrade", "node-1", "0.0.8", "--sha256",
         sha, "--gateway", gw.url], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=cluster.base_env() | {"LLMGW_ADMIN_TOKEN": ADMIN})
    assert ctl.returncode == 1, (ctl.stdout, ctl.stderr)
    assert "answered 422: Upgrade failed: pip download exited with 1" in ctl.stderr
    with gw.admin() as admin:  # refused by the gateway, before the agent
        for body in ({"version": "1.0 --pre", "sha256": sha},
                     {"version": "0.0.8", "sha256": sha, "index_url": "https://evil/simple"},
                     {"version": "0.0.8"}):
            r = admin.post("/admin/nodes/node-1/upgrade", json=body)
            assert r.status_code == 422, r.text
    assert version() == new_version and agent.popen.poll() is None
    assert os.path.exists(tmp_path / "agent-node-1" / "engines.json")


def test_min_agent_version_setting_must_be_a_version() -> None:
    from pydantic import ValidationError

    from app.gateway.settings import Settings

    assert Settings(min_agent_version="0.1.0").min_agent_version == "0.1.0"
    with pytest.raises(ValidationError, match="is not a version"):
        Settings(min_agent_version="x y")
