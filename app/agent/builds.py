"""The vLLM build a node runs (docs/architecture.md, "Node operations").

The operator chooses per node (`nodeconf/{node}`: auto, cu13, cu129, none);
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
import shlex
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

# What `pip install` gets for each build: vLLM's CUDA 13 wheels, or the
# same version's CUDA 12.9 wheels with PyTorch's cu129 torch.
PIP_ARGS = {
    "cu13": "vllm --extra-index-url https://download.pytorch.org/whl/cu130",
    "cu129": ("vllm --extra-index-url https://wheels.vllm.ai/cu129 "
              "--extra-index-url https://download.pytorch.org/whl/cu129"),
}
# Placeholders: {build}, {venv}, {pip_args} (shell-quoted where paths).
DEFAULT_INSTALLER = "python3 -m venv {venv} && {venv}/bin/pip install --quiet {pip_args}"
DEFAULT_CHECK = ("{venv}/bin/python -c \"import torch; a = torch.ones(64, 64, device='cuda'); "
                 "print('matmul sum', float((a @ a).sum()))\"")
TAIL_LINES = 20


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
    check: str = DEFAULT_CHECK
    # LLMGW_VLLM_BIN: the operator's own vLLM, used as it is.
    operator_bin: str = ""
    # Seconds an install (a few GB of wheels) and a check may take.
    install_timeout: float = 3600.0
    check_timeout: float = 300.0


def builds_config() -> BuildsConfig:
    """From the agent's environment: LLMGW_AGENT_VLLM_INSTALLER and
    LLMGW_AGENT_VLLM_CHECK, command templates run by `sh -c` ({build},
    {venv}, {pip_args} replaced), and LLMGW_VLLM_BIN."""
    return BuildsConfig(
        installer=os.environ.get("LLMGW_AGENT_VLLM_INSTALLER") or DEFAULT_INSTALLER,
        check=os.environ.get("LLMGW_AGENT_VLLM_CHECK") or DEFAULT_CHECK,
        operator_bin=os.environ.get("LLMGW_VLLM_BIN", ""))


@dataclass
class Builds:
    cfg: BuildsConfig
    work_dir: Path
    # The operator's choice as last told by the gateways.
    choice: str = "auto"
    # The build that passed its check ("operator": LLMGW_VLLM_BIN); "" none.
    usable: str = ""
    detail: str = ""
    # (choice, build) last tried and failed: not retried until the choice
    # changes or the agent restarts (an install is minutes of downloads).
    _failed: tuple[str, str] | None = None
    _running: str = field(default="")

    def __post_init__(self) -> None:
        if self.cfg.operator_bin:
            self.usable, self.detail = "operator", "LLMGW_VLLM_BIN: the operator's own vLLM"

    def venv(self, build: str) -> Path:
        return self.work_dir / "engines" / build / "venv"

    def vllm_bin(self) -> str | None:
        """The vllm executable replicas start with; None: no usable build."""
        if self.cfg.operator_bin:
            return self.cfg.operator_bin
        if not self.usable:
            return None
        return str(self.venv(self.usable) / "bin" / "vllm")

    async def step(self, cuda_version: str) -> bool:
        """Brings the node to the chosen build: installs it unless already
        there, then runs the GPU check. Returns whether anything ran."""
        if self.cfg.operator_bin:
            return False
        build, why = pick(self.choice, cuda_version)
        if build is None:
            changed = (self.usable, self.detail) != ("", why)
            self.usable, self.detail = "", why
            return changed
        if build == self.usable or self._failed == (self.choice, build):
            return False
        self.usable = ""
        self._running = build
        try:
            ok, self.detail = await self._install_and_check(build)
        finally:
            self._running = ""
        if ok:
            self.usable, self._failed = build, None
        else:
            self._failed = (self.choice, build)
        return True

    def status(self) -> str:
        """For the inventory: what is being installed, or how the check went."""
        text = f"installing {self._running}" if self._running else self.detail
        return text if len(text) <= 4000 else "..." + text[-3997:]

    async def _install_and_check(self, build: str) -> tuple[bool, str]:
        venv = self.venv(build)
        log = venv.parent / "install.log"
        if not (venv / "bin" / "vllm").exists():
            logger.info("installing vLLM build %s into %s", build, venv)
            cmd = self.cfg.installer.format(build=build, venv=shlex.quote(str(venv)),
                                            pip_args=PIP_ARGS[build])
            code, tail = await _run(cmd, log, self.cfg.install_timeout)
            if code != 0:
                logger.error("installing vLLM build %s failed (%s)", build, code)
                return False, f"{build}: install failed ({code}); last lines:\n{tail}"
            if not (venv / "bin" / "vllm").exists():
                return False, f"{build}: the installer left no {venv}/bin/vllm"
        cmd = self.cfg.check.format(build=build, venv=shlex.quote(str(venv)))
        code, tail = await _run(cmd, venv.parent / "check.log", self.cfg.check_timeout)
        if code != 0:
            logger.error("GPU check of vLLM build %s failed (%s)", build, code)
            return False, f"{build}: GPU check failed ({code}); output:\n{tail}"
        logger.info("vLLM build %s passed its GPU check", build)
        return True, f"{build}: GPU check passed; output:\n{tail}"


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
