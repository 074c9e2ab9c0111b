"""What GPUs a node has.

Discovery asks `nvidia-smi` (shipped with the NVIDIA driver) rather than a
CUDA library, so that the agent itself needs no CUDA install. A node
without it, or where it fails, has no GPUs: a CPU node. `--gpus N` declares
N GPUs instead, for tests and for nodes where discovery is not wanted.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

from app.control.state import GpuInfo

logger = logging.getLogger(__name__)

_QUERY = "--query-gpu=index,name,memory.total,uuid"


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """Parses `nvidia-smi --query-gpu=index,name,memory.total,uuid
    --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        mem = int(parts[2]) if parts[2].isdigit() else 0
        gpus.append(GpuInfo(index=int(parts[0]), name=parts[1], memory_mib=mem, uuid=parts[3]))
    return gpus


def discover(nvidia_smi: str = "nvidia-smi", timeout: float = 10.0) -> list[GpuInfo]:
    exe = shutil.which(nvidia_smi)
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, _QUERY, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        logger.warning("nvidia-smi failed (%s): treating this node as a CPU node", exc)
        return []
    return parse_nvidia_smi(out)


def declared(count: int) -> list[GpuInfo]:
    return [GpuInfo(index=i, name="declared") for i in range(count)]
