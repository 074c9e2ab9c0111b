"""The shared state: key layout and the JSON shapes stored under each key.

This is the vocabulary of docs/architecture.md's "State" table. Keys are
relative to the store prefix. Values are JSON; unknown fields are ignored on
read so that an older gateway survives a newer one's writes during an
upgrade.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
)

# The spelling of names and the model spec live in modules of their own;
# they are part of this vocabulary, so `state.X` names them too.
from app.control.names import Engine, Phase, check_labels, check_name
from app.control.spec import (
    EngineArg,
    External,
    ModelSpec,
    Profile,
    ReplicaRange,
    StoredModel,
    check_engine_arg,
    check_weights,
    engine_arg_name,
)

LEADER = "leader"
# This store's id: random, created once by the first gateway to start on it
# (app/control/storeid.py). Revisions are compared only within one id: a new
# etcd, even one bootstrapped with the same cluster id, counts from 1 again.
STORE_ID = "store"
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
# Each gateway's claims on client keys' limits, `keyshares/{gateway}`, bound
# to its election lease (app/key_shares.py; docs/architecture.md, Client keys).
KEY_SHARES = "keyshares/"
# Fabric test results, `fabric/{from}/{to}`: the last TCP bandwidth measured
# from one node's agent to another's, written by the gateway that ran the test
# (app/api/fabric.py), kept for placing multi-node replicas.
FABRIC = "fabric/"

__all__ = [
    "CATALOG_SERIAL", "FABRIC", "GATEWAYS", "KEYS", "KEY_SHARES", "KEY_USAGE", "LEADER",
    "MAX_DETAIL", "MAX_GPUS", "MAX_REPLICAS_REPORTED", "MAX_TEXT", "MODELS", "NODECONF",
    "NODES", "QUOTAS", "REPLICAS", "STATUS", "STORE_ID", "USAGE", "ClientKey", "Engine",
    "EngineArg", "External", "FabricResult", "GatewayInfo", "GpuInfo", "KeyLimits", "KeyShare",
    "KeyShares", "KeyUsage", "LeaderInfo", "ModelSpec", "ModelUsage", "NodeConf", "NodeInfo",
    "Phase", "Profile", "Quota", "Replica", "ReplicaRange", "ReplicaStatus", "StoreId",
    "StoredModel", "Usage", "check_address", "check_engine_arg", "check_labels", "check_name",
    "check_weights", "engine_arg_name", "fit", "replica_phase",
]


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


# Caps on what an agent reports with its node token (docs/architecture.md,
# Security): each field is bounded, so that a node's inventory or a replica's
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


class _Stored(BaseModel):
    # Tolerate fields written by a newer gateway.
    model_config = ConfigDict(extra="ignore")



class GpuInfo(_Stored):
    index: int
    name: str = Field(default="", max_length=256)
    memory_mib: int = 0
    uuid: str = Field(default="", max_length=256)
    # As last discovered (app/agent/gpus.py); None where unknown (declared
    # GPUs, MIG mode). Refreshed now and then, not per heartbeat.
    memory_free_mib: int | None = None
    utilization: int | None = None  # percent


class NodeInfo(_Stored):
    """An agent's report of its node, refreshed by each heartbeat."""

    name: str
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=MAX_GPUS)
    engines: list[Engine] = Field(default_factory=list, max_length=8)
    address: str = Field(default="", max_length=253)
    version: str = Field(default="", max_length=64)
    # Added for node operations (docs/architecture.md); older agents leave
    # them empty and older gateways ignore them.
    driver_version: str = Field(default="", max_length=64)
    cuda_version: str = Field(default="", max_length=64)
    # How the GPUs were found: "nvml", "nvidia-smi", "declared", "none (why)".
    gpu_discovery: str = Field(default="", max_length=MAX_TEXT)
    cpus: int = 0
    memory_mib: int = 0
    # The agent's own API (logs, cached weights): http://ADDRESS:PORT.
    api_url: str = Field(default="", max_length=MAX_TEXT)
    # The vLLM build replicas would use (docs/architecture.md, "Node
    # operations"): "cu13", "cu129", "operator" (LLMGW_VLLM_BIN), "" none
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


EngineBuild = Literal["auto", "cu13", "cu129", "none"]
# The vLLM version engine builds install (`vllm==X`) where neither the
# node's conf nor the gateways' LLMGW_VLLM_VERSION names one: pinned, so
# that every node runs the same vLLM whatever day it installed it.
DEFAULT_VLLM_VERSION = "0.33.0"
# A version pip reads as one `==` pin and a shell as one word.
VLLM_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!]{0,63}$")


def check_vllm_version(v: str) -> str:
    if not VLLM_VERSION.match(v):
        raise ValueError(f"{v!r} is not a vLLM version (e.g. {DEFAULT_VLLM_VERSION})")
    return v


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
    engine_build: EngineBuild = Field(
        default="auto", description="the vLLM build its agent installs; none: no vLLM here")
    vllm_version: str = Field(
        default="", max_length=64,
        description="the vLLM version that build installs; empty: LLMGW_VLLM_VERSION")

    @field_validator("pool")
    @classmethod
    def _pool(cls, v: str) -> str:
        return check_name(v, "pool")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)

    @field_validator("vllm_version")
    @classmethod
    def _vllm_version(cls, v: str) -> str:
        return check_vllm_version(v) if v else v


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
    # The id (keys.secret_id, 8 hex digits, not secret) of the shared secret
    # its engine key derives from; "" in replicas placed before it was
    # recorded (keys.replica_secret_id says what those count as). A replica
    # of another secret than the fleet's is rolled like a changed spec.
    secret: str = ""
    # Why the leader drained it, when that is worth telling its model's
    # owner (displaced by a higher-priority model).
    drain_reason: str = ""
    # Set when the leader decides to remove it: routers drop it at once, the
    # engine is stopped only after the drain period (DESIGN invariant 3).
    draining_since: float | None = None


class ReplicaStatus(_Stored):
    """A replica as its agent last saw it."""

    id: str = Field(max_length=256)
    node: str = Field(max_length=128)
    phase: Phase
    url: str = Field(default="", max_length=MAX_TEXT)
    detail: str = Field(default="", max_length=MAX_DETAIL)
    updated: float = 0.0
    # Failed, and its agent no longer restarts it (it kept dying): the
    # leader places it elsewhere (app/control/plan.py).
    given_up: bool = False


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
    # Of `requests`, those whose tokens are estimates: streams that ended
    # before the engine reported their usage (app/router/limits.py).
    estimated: int = 0


class KeyUsage(_Stored):
    """`keyusage/{key id}/{gateway}`: one gateway's totals for one key."""

    key: str
    gateway: str
    models: dict[str, ModelUsage] = Field(default_factory=dict)
    updated: float = 0.0


class KeyShare(_Stored):
    """One gateway's part of one client key's limits. Keyed by limit name
    (`requests_per_minute`, `tokens_per_minute`, `concurrent_requests`):
    `claims`, what this gateway may admit (all gateways' claims together stay
    within the limit: raised only by a transaction conditioned on every
    other gateway's record); `used`, what it holds now (requests and tokens
    in its window, requests in flight)."""

    claims: dict[str, int] = Field(default_factory=dict)
    used: dict[str, int] = Field(default_factory=dict)
    asked: int = 0  # requests asked for (admitted or refused) lately
    refused: list[str] = Field(default_factory=list)  # limits it refused on lately


class KeyShares(_Stored):
    """`keyshares/{gateway}`: a gateway's claims, by key id."""

    gateway: str
    keys: dict[str, KeyShare] = Field(default_factory=dict)
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
    # Requests held here per model, waiting for a replica (scale from zero).
    held: dict[str, int] = Field(default_factory=dict)
    updated: float = 0.0
    # Each replica's engine load as this gateway last polled it (vLLM's
    # running + waiting requests, which count every gateway's requests):
    # fresh polls only, zeros included. A replica left out is unknown, never
    # idle (docs/architecture.md, Reconciler: scaling). Snapshots written
    # before load-based scaling have none: their replicas read as unknown.
    loads: dict[str, float] = Field(default_factory=dict)
    # The same polls' waiting requests and KV-cache use (0 to 1), apart:
    # what the leader calls saturation (Scaling on load). `loads` keeps
    # running + waiting for leaders older than these; a snapshot without
    # them says nothing of its replicas' queues.
    waiting: dict[str, float] = Field(default_factory=dict)
    kv_cache: dict[str, float] = Field(default_factory=dict)


class FabricResult(_Stored):
    """One direction of a fabric test (`fabric/{from}/{to}`), as the receiving
    agent counted it: `bytes` in `seconds`, first byte to last."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    from_: str = Field(..., alias="from")
    to: str
    gbps: float
    bytes: int
    seconds: float
    at: float  # Unix time of the measurement


class GatewayInfo(_Stored):
    id: str
    url: str
    version: str
    started: float
    # The id of the shared secret it derives with (keys.secret_id): the
    # leader rolls replicas onto a new secret only once every gateway has it.
    secret: str = ""


class LeaderInfo(_Stored):
    id: str
    url: str


class StoreId(_Stored):
    id: str
    created: float = 0.0


def replica_phase(rep: Replica, status: ReplicaStatus | None, node_seen: bool = True) -> str:
    """A replica's phase as the fleet shows it: `stopping` once the leader
    drains it; `unknown` while its node is not heard from (`node_seen`
    False: the agent's last report, "ready" say, is no promise, and the
    router leaves the replica out); `pending` until its agent has reported;
    else the agent's."""
    if rep.draining_since is not None:
        return "stopping"
    if not node_seen:
        return "unknown"
    return status.phase if status is not None else "pending"
