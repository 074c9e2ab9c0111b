"""The shared state: key layout and the JSON shapes stored under each key.

This is the vocabulary of docs/architecture.md's "State" table. Keys are
relative to the store prefix. Values are JSON; unknown fields are ignored on
read so that an older gateway survives a newer one's writes during an
upgrade.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

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
# Usage per client key, per gateway: `keyusage/{key id}/{gateway}` holds that
# gateway's running totals for the key, written in batches (app/control/
# key_usage.py), never per request. One writer per key, so no write races.
KEY_USAGE = "keyusage/"
# The operator's choices per node (cordon, drain, pool, labels) and capacity
# quotas per scope: written by the admin API, read by placement.
NODECONF = "nodeconf/"
QUOTAS = "quotas/"
# One usage snapshot per gateway, bound to its election lease (app/control/usage.py).
USAGE = "usage/"

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
    min: int = Field(default=1, ge=0, le=64, description="replicas kept running at all times")
    max: int = Field(default=1, ge=0, le=64, description="most replicas under load")

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaRange:
        if self.max < self.min:
            raise ValueError(f"replicas.max ({self.max}) is below replicas.min ({self.min})")
        return self


# One engine flag per list item, "--name" or "--name=value": never a bare
# value (a flag's argument given as the next item could become the weights or
# another flag's value) and never a short "-x" flag, whose meaning we cannot
# check. Which names are refused depends on the engine (app/control/catalog.py).
_ENGINE_ARG = re.compile(r"^--[a-z0-9][a-z0-9_-]{0,63}(=[^\x00-\x1f\x7f]{0,1024})?$")


def check_engine_arg(value: str) -> str:
    if not _ENGINE_ARG.match(value):
        raise ValueError(
            f"engine argument {value!r} must be '--name' or '--name=value' (lower-case name, "
            "one list item per flag: '--max-model-len=4096', not '--max-model-len', '4096')")
    return value


def engine_arg_name(arg: str) -> str:
    """The flag's name, spelled with dashes: vLLM reads '--max_model_len' as
    '--max-model-len', so both spellings are compared as one."""
    return arg[2:].split("=", 1)[0].replace("_", "-")


EngineArg = Annotated[str, AfterValidator(check_engine_arg)]


class Profile(BaseModel):
    """One way to run a model: engine, GPUs per replica and engine flags."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="default", max_length=64, description="unique within the model")
    engine: Engine = "vllm"
    gpus: int | None = Field(
        default=None, ge=0, le=16,
        description="GPUs per replica; default 1 for vllm, 0 for llamacpp")
    gpu_memory_gib: float | None = Field(
        default=None, gt=0, le=4096, description="GPU memory a replica needs, GiB per GPU")
    engine_args: list[EngineArg] = Field(
        default_factory=list, max_length=64,
        description="extra engine flags, each '--name' or '--name=value'; flags llmgw sets "
                    "itself (host, port, served model name, keys...) are refused")
    priority: int = Field(default=0, ge=0, le=1000, description="higher is routed to first")
    weight: float = Field(
        default=1.0, gt=0, le=1000,
        description="share of its priority's requests, relative to other profiles' replicas")
    pool: str = Field(
        default="default", max_length=64, description="the pool its replicas count in")

    @field_validator("name", "pool")
    @classmethod
    def _names(cls, v: str) -> str:
        return check_name(v, "name")

    @property
    def gpu_count(self) -> int:
        if self.gpus is not None:
            return self.gpus
        return 1 if self.engine == "vllm" else 0


class External(BaseModel):
    """A model served by a provider outside the fleet."""

    model_config = ConfigDict(extra="forbid")

    # Checked by app/control/catalog.py: http(s), never link-local or metadata.
    url: str = Field(..., max_length=2048,
                     description="the provider's address; requests go to URL/v1/...")
    model: str = Field(..., min_length=1, max_length=256, pattern=r"^[^\x00-\x20\x7f]+$",
                       description="the model's name at the provider")
    api_key_file: str | None = Field(
        default=None, max_length=512,
        description="absolute path, on every gateway, of a file holding the provider's key; "
                    "read at each publish, so a rotated key is used without a restart")

    @field_validator("api_key_file")
    @classmethod
    def _key_file(cls, v: str | None) -> str | None:
        if v is not None and (not _PATH.match(v) or posixpath.normpath(v) != v):
            raise ValueError(f"{v!r} is not an absolute, normalised path")
        return v


class ModelSpec(BaseModel):
    """What an operator PUTs at /admin/models/{name}.

    Two forms (docs/architecture.md, Catalog): the flat one, `engine` and
    `gpus` beside the weights (one implicit profile named "default", the only
    form before profiles existed, so older specs keep their meaning), or
    `profiles: [...]` without them. An `external` model has neither, nor
    weights, replicas, scaling or quota. A field left out is stored left out
    (None), so an export reads back as it was written. Rules across fields
    are checked by app/control/catalog.py, which names the field in error.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None, min_length=1, max_length=512,
        description="weights: a hub id ('org/name' or 'name') or an absolute path under the "
                    "gateway's model roots (LLMGW_MODEL_ROOTS); absent for external models")
    revision: str | None = Field(
        default=None, max_length=128,
        description="for a hub id: the branch, tag or commit of the weights (vLLM's --revision)")
    aliases: list[str] = Field(default_factory=list, description="other names clients may use")
    engine: Engine | None = Field(
        default=None, description="flat form: the engine (default vllm)")
    gpus: int | None = Field(
        default=None, ge=0, le=16,
        description="flat form: GPUs per replica (default 1; 0 for llamacpp)")
    profiles: list[Profile] | None = Field(
        default=None, min_length=1, max_length=8,
        description="ways to run the model, instead of the flat engine and gpus; placement "
                    "uses the first")
    replicas: ReplicaRange | None = Field(
        default=None, description="default {min: 1, max: 1}")
    load_target: int | None = Field(
        default=None, ge=1, le=10000, description="requests in flight per replica to scale at")
    idle_timeout: float | None = Field(
        default=None, gt=0, le=30 * 86400,
        description="seconds without requests before scaling down to replicas.min; "
                    "required when replicas.min is 0 and max is not")
    quota: str | None = Field(default=None, max_length=128, description="capacity-quota scope")
    external: External | None = None

    @field_validator("model")
    @classmethod
    def _weights(cls, v: str | None) -> str | None:
        return check_weights(v) if v is not None else v

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

    @field_validator("quota")
    @classmethod
    def _quota(cls, v: str | None) -> str | None:
        return check_name(v, "quota scope") if v is not None else v

    @property
    def profile_list(self) -> list[Profile]:
        """The profiles, the flat form's implicit one included; none if external."""
        if self.external is not None:
            return []
        if self.profiles is not None:
            return self.profiles
        return [Profile(engine=self.engine or "vllm", gpus=self.gpus)]

    @property
    def replica_range(self) -> ReplicaRange:
        if self.external is not None:
            return ReplicaRange(min=0, max=0)
        return self.replicas if self.replicas is not None else ReplicaRange()

    def spec_dump(self) -> dict[str, Any]:
        """The spec as given: fields left out stay out (see the class doc)."""
        return self.model_dump(mode="json", exclude_unset=True, exclude_none=True,
                               include=set(ModelSpec.model_fields))


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


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    for k, val in labels.items():
        check_name(k, "label name")
        if len(val) > 256 or any(ord(c) < 0x20 or ord(c) == 0x7f for c in val):
            raise ValueError(f"label {k!r}: its value must be at most 256 printable characters")
    return labels


class NodeConf(_Stored):
    """The operator's choices for one node (`nodeconf/{node}`), kept apart
    from `nodes/{node}`, which its agent rewrites and which vanishes with its
    lease: a cordon must outlive an agent restart."""

    cordoned: bool = Field(default=False, description="no new replicas are placed here")
    draining: bool = Field(
        default=False, description="cordoned, and its replicas are moved to other nodes")
    pool: str = Field(default="default", max_length=64,
                      description="only profiles of this pool are placed here")
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)

    @field_validator("pool")
    @classmethod
    def _pool(cls, v: str) -> str:
        return check_name(v, "pool")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)


class Quota(_Stored):
    """A capacity quota (`quotas/{scope}`): the most GPUs the replicas of the
    models naming this scope (`quota` in their spec) may hold together."""

    max_gpus: int = Field(..., ge=0, le=100_000, description="GPUs the scope may hold")


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
    # The profile it runs and that profile's extra engine flags (already
    # checked by app/control/catalog.py), for the agent to pass to the engine.
    profile: str = ""
    engine_args: list[str] = Field(default_factory=list)
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


class KeyLimits(BaseModel):
    """A client key's limits, for all gateways together; None: no limit."""

    model_config = ConfigDict(extra="ignore")

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="prompt + completion tokens, charged when an answer ends")
    concurrent_requests: int | None = Field(default=None, ge=1)


class ClientKey(_Stored):
    """A client API key's record. The key itself is never stored.

    Records written before limits existed load with the defaults below
    (no prefix, no limits, no expiry)."""

    id: str
    name: str
    created: float
    models: list[str] = Field(default_factory=list)
    # The key's first characters, shown in listings so an operator can tell
    # keys apart; the key itself is shown once, at creation.
    prefix: str = ""
    limits: KeyLimits = Field(default_factory=KeyLimits)
    # Unix time after which the key is refused; None: never.
    expires: float | None = None


class ModelUsage(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class KeyUsage(_Stored):
    """`keyusage/{key id}/{gateway}`: one gateway's totals for one key."""

    key: str
    gateway: str
    models: dict[str, ModelUsage] = Field(default_factory=dict)
    updated: float = 0.0


class Usage(_Stored):
    """One gateway's usage snapshot at `usage/{gateway}`, written every few
    seconds when it changed (never per request) and bound to the gateway's
    election lease, so a dead gateway's snapshot goes with it."""

    gateway: str
    # The store revision this gateway's router tables reflected when the
    # snapshot was taken: a replica drained at or before it gets no new
    # request from this gateway, so its count below can only fall.
    revision: int = 0
    # Requests in flight on this gateway, per replica (only those above 0).
    inflight: dict[str, int] = Field(default_factory=dict)
    # Unix time this gateway last had a request for each model (now, for a
    # model with one in flight).
    last_used: dict[str, float] = Field(default_factory=dict)
    updated: float = 0.0


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
