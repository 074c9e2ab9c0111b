"""The shared state: key layout and the JSON shapes stored under each key.

This is the vocabulary of DESIGN.md's "State in etcd" table. Keys are
relative to the store prefix. Values are JSON; unknown fields are ignored on
read so that an older gateway survives a newer one's writes during an
upgrade.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LEADER = "leader"
GATEWAYS = "gateways/"
MODELS = "catalog/models/"
# Bumped by every catalog write, in the same transaction, which is conditioned
# on the value read: two admins racing on two gateways (for one alias, say)
# cannot both win, since the second's condition no longer holds.
CATALOG_SERIAL = "catalog/serial"
NODES = "nodes/"
REPLICAS = "replicas/"
STATUS = "status/"
KEYS = "keys/"

# OpenAI model ids often hold a slash ("org/model"); spaces, control
# characters and a leading dot or slash do not belong in a key or a URL.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")

Engine = Literal["vllm", "llamacpp"]
Phase = Literal["starting", "ready", "failed", "stopping", "stopped"]


def check_name(value: str, what: str = "name") -> str:
    if not _NAME.match(value) or "//" in value or value.endswith("/"):
        raise ValueError(
            f"{what} {value!r} must be 1-128 characters of letters, digits and ._:/@+- "
            "starting with a letter or digit"
        )
    return value


# A model hub id: "name" or "org/name", as Hugging Face spells them.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
# Printable, no whitespace: a path is passed to the engine as one argument.
_PATH = re.compile(r"^/[^\x00-\x20\x7f]{1,511}$")


def check_weights(value: str) -> str:
    """A model's weights: a hub id, or an absolute, normalised file path.

    Typed at the boundary: the value becomes an engine's argument, so one that
    starts with "-" (an engine flag in disguise) or walks out of a folder with
    ".." is refused here, before anything runs it. Whether a path lies under
    the configured model roots is checked by the admin API, which has them.
    """
    if value.startswith("/"):
        if not _PATH.match(value) or posixpath.normpath(value) != value:
            raise ValueError(
                f"{value!r} is not an absolute, normalised path (no '..', '//', './' "
                "or spaces)")
        return value
    if not _HUB_ID.match(value) or ".." in value:
        raise ValueError(
            f"{value!r} is neither a hub id ('name' or 'org/name': letters, digits and ._-, "
            "not starting with '-' or '.') nor an absolute path")
    return value


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


class _Stored(BaseModel):
    # Tolerate fields written by a newer gateway.
    model_config = ConfigDict(extra="ignore")


class ReplicaRange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min: int = Field(1, ge=0, le=64, description="replicas kept running at all times")
    max: int = Field(1, ge=0, le=64, description="most replicas under load")

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaRange:
        if self.max < self.min:
            raise ValueError(f"replicas.max ({self.max}) is below replicas.min ({self.min})")
        return self


class ModelSpec(BaseModel):
    """What an operator PUTs at /admin/models/{name}."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        ..., min_length=1, max_length=512,
        description="weights: a hub id ('org/name' or 'name') or an absolute path under the "
                    "gateway's model roots (LLMGW_MODEL_ROOTS)",
    )
    revision: str | None = Field(
        None, max_length=128,
        description="for a hub id: the branch, tag or commit of the weights (vLLM's --revision)",
    )
    aliases: list[str] = Field(default_factory=list, description="other names clients may use")
    engine: Engine = "vllm"
    gpus: int = Field(1, ge=0, le=16, description="GPUs per replica (0 for llamacpp)")
    replicas: ReplicaRange = Field(default_factory=lambda: ReplicaRange(min=1, max=1))

    @field_validator("model")
    @classmethod
    def _weights(cls, v: str) -> str:
        return check_weights(v)

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str | None) -> str | None:
        if v is not None and (not _REVISION.match(v) or ".." in v):
            raise ValueError(f"revision {v!r} must be letters, digits and ._/-, "
                             "not starting with '-'")
        return v

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        for a in v:
            check_name(a, "alias")
        if len(set(v)) != len(v):
            raise ValueError("aliases repeat")
        return v

    @model_validator(mode="after")
    def _engine_gpus(self) -> ModelSpec:
        if self.revision is not None and self.model.startswith("/"):
            raise ValueError("revision applies to a hub id, not to a path")
        if self.engine == "llamacpp":
            if "gpus" in self.model_fields_set and self.gpus != 0:
                raise ValueError("engine llamacpp runs on CPU nodes: gpus must be 0")
            self.gpus = 0
        elif self.gpus < 1:
            raise ValueError("engine vllm needs gpus >= 1")
        return self


class StoredModel(ModelSpec):
    model_config = ConfigDict(extra="ignore")
    name: str
    created: float = 0.0  # unix time of the first PUT; OpenAI's `created`


class GpuInfo(_Stored):
    index: int
    name: str = ""
    memory_mib: int = 0
    uuid: str = ""
    # As last discovered (app/agent/gpus.py); None where unknown (declared
    # GPUs, MIG mode). Refreshed now and then, not per heartbeat.
    memory_free_mib: int | None = None
    utilization: int | None = None  # percent


class NodeInfo(_Stored):
    """An agent's report of its node, refreshed by each heartbeat."""

    name: str
    gpus: list[GpuInfo] = Field(default_factory=list)
    engines: list[Engine] = Field(default_factory=list)
    address: str = ""
    version: str = ""
    # Added for node operations (docs/architecture.md); older agents leave
    # them empty and older gateways ignore them.
    driver_version: str = ""
    cuda_version: str = ""
    # How the GPUs were found: "nvml", "nvidia-smi", "declared", "none (why)".
    gpu_discovery: str = ""
    cpus: int = 0
    memory_mib: int = 0
    # The agent's own API (logs, cached weights): http://ADDRESS:PORT.
    api_url: str = ""

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


class Replica(_Stored):
    """A desired replica: written by the leader alone, in fenced transactions."""

    id: str
    model: str
    node: str
    gpus: list[int] = Field(default_factory=list)
    engine: Engine = "vllm"
    weights: str
    # The hub revision of the weights (the spec's `revision`), None for the default.
    weights_revision: str | None = None
    # Set when the leader decides to remove it: routers drop it at once, the
    # engine is stopped only after the drain period (DESIGN invariant 3).
    draining_since: float | None = None


class ReplicaStatus(_Stored):
    """A replica as its agent last saw it."""

    id: str
    node: str
    phase: Phase
    url: str = ""
    detail: str = ""
    updated: float = 0.0


class ClientKey(_Stored):
    """A client API key's record. The key itself is never stored."""

    id: str
    name: str
    created: float
    models: list[str] = Field(default_factory=list)


class GatewayInfo(_Stored):
    id: str
    url: str
    version: str
    started: float


class LeaderInfo(_Stored):
    id: str
    url: str


def replica_phase(rep: Replica, status: ReplicaStatus | None) -> str:
    """A replica's phase as the fleet shows it: `stopping` once the leader
    drains it, `pending` until its agent has reported, else the agent's."""
    if rep.draining_since is not None:
        return "stopping"
    return status.phase if status is not None else "pending"
