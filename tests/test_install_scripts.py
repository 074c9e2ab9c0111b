"""The README's first command stays light: scripts/install.sh installs what
running needs, and the tests' tools (etcd, haproxy, Chromium, the `test`
extra with Playwright) come with scripts/install-test.sh, which CI and the
README's test command run too. The scripts run here for real, against stubs
of apt-get and of the venv's python that write down what they were asked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the scripts call that we let through to the real programs; gcc, cmake,
# curl, etcd and haproxy stay out of PATH so the scripts ask for them.
REAL_TOOLS = ("bash", "dirname", "cat", "ls", "head", "basename", "mkdir", "rm", "mv",
              "nproc", "python3")
TEST_ONLY_APT = {"etcd-server", "haproxy", "chromium", "prometheus"}


def rig(tmp: Path) -> tuple[Path, dict[str, str]]:
    repo = tmp / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    shutil.copytree(ROOT / ".ci", repo / ".ci")
    log = tmp / "calls.log"
    stub = f'#!/bin/sh\necho "$(basename "$0") $*" >>{log}\n'
    bindir = tmp / "bin"
    bindir.mkdir()
    for name in REAL_TOOLS:
        real = shutil.which(name)
        assert real, name
        (bindir / name).symlink_to(real)
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
    assert any("-e .[cpu]" in line for line in pips), pips
    assert not [line for line in pips if re.search(r"\[[^]]*test|playwright|pytest", line)], pips


def test_install_test_sh_brings_the_test_tools(tmp_path: Path) -> None:
    repo, env = rig(tmp_path)
    run(repo, env, "scripts/install-test.sh")
    lines = calls(tmp_path)
    assert {"etcd-server", "prometheus"} <= apt_packages(lines), lines
    # These two are looked for at their Debian paths too, whatever PATH says.
    for package, path in (("haproxy", "/usr/sbin/haproxy"), ("chromium", "/usr/bin/chromium")):
        assert (package in apt_packages(lines)) == (not os.path.exists(path)), lines
    assert any("-e .[test]" in line for line in pip_installs(lines)), lines


def test_ci_runs_the_readme_test_command_and_gets_everything(tmp_path: Path) -> None:
    repo, env = rig(tmp_path)
    run(repo, env, ".ci/run")
    lines = calls(tmp_path)
    assert {"etcd-server", "curl", "cmake"} <= apt_packages(lines), lines
    pips = " ".join(pip_installs(lines))
    assert "-e .[cpu]" in pips and "-e .[test]" in pips, pips
    ran = [line.split()[2] if line.startswith("python -m ") else line.split()[0]
           for line in lines if line.startswith(("python -m ", "lint-imports"))]
    # The tests run after both installs, the import rules beside lint and types.
    assert ran[-4:] == ["ruff", "mypy", "lint-imports", "pytest"], lines

    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```sh\n(bash scripts/[^\n]*)\n```", readme)
    assert commands[0] == "bash scripts/install.sh && bash scripts/quickstart.sh", commands
    ci = re.findall(r"^bash (scripts/\S+)$", (ROOT / ".ci/run").read_text(), re.M)
    assert commands[1] == " && ".join(f"bash {s}" for s in ci), (commands, ci)
